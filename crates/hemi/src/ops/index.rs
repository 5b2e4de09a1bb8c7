//! Embedding lookup, index_select, concat and stack.
