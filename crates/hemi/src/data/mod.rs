//! Data sets, transforms and the DataLoader.
