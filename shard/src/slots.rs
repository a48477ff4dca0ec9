//! slots (being written)
