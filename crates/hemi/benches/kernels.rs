//! Placeholder for per-kernel criterion benches (one per op family; the speed issue fills it).
fn main() {}
