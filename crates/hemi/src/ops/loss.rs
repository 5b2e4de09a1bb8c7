//! Softmax, log-softmax and the losses (cross-entropy, NLL, MSE), computed in F32.
