//! The library's unit tests: they live here, not in `src/`, so the test command builds
//! the library once (a `#[cfg(test)]` module makes cargo compile the whole library a
//! second time as a test binary).

mod device;
mod dist_ring;
mod dist_zero;
mod models_registry;
mod train_recipe;
