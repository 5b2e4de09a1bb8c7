//! Dropout with a seeded generator.
