//! timer (being written)
