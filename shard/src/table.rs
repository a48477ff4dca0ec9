//! table (being written)
