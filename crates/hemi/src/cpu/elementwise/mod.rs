//! Element by element: unary and binary maps with their backward, casts' chunked loops,
//! the loss scaler's unscale-and-check and the gradient statistics (`amp`), and the
//! optimizer updates (`optim`).

pub mod amp;
pub mod map;
pub mod optim;
