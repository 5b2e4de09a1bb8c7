//! The nodes of hemi's layers in eval mode. Each method takes the layer's `state_dict`
//! prefix (its weights become initializers named `prefix.weight`, ... and its output value
//! is named after the prefix) and the name of its input value, and returns its output's name.

use super::{attr_float, attr_int, attr_ints, Graph};
use crate::error::{Error, Result};
use crate::nn::{BatchNorm2d, Conv2d, Embedding, LayerNorm, Linear, MaxPool2d};

impl Graph {
    /// `Conv` with the layer's stride, padding (the same on both sides), dilation and groups.
    pub fn conv2d(&mut self, prefix: &str, c: &Conv2d, x: &str) -> Result<String> {
        let w = self.param(&format!("{prefix}.weight"), &c.weight, false)?;
        let mut inputs = vec![x.to_string(), w];
        if let Some(b) = &c.bias {
            inputs.push(self.param(&format!("{prefix}.bias"), b, false)?);
        }
        let shape = c.weight.shape();
        let o = c.opts;
        let (ph, pw) = (o.padding.0 as i64, o.padding.1 as i64);
        let inputs: Vec<&str> = inputs.iter().map(String::as_str).collect();
        Ok(self.node(
            "Conv",
            prefix,
            &inputs,
            vec![
                attr_ints("kernel_shape", &[shape[2] as i64, shape[3] as i64]),
                attr_ints("strides", &[o.stride.0 as i64, o.stride.1 as i64]),
                attr_ints("pads", &[ph, pw, ph, pw]),
                attr_ints("dilations", &[o.dilation.0 as i64, o.dilation.1 as i64]),
                attr_int("group", o.groups as i64),
            ],
        ))
    }

    /// `BatchNormalization` in inference mode (running statistics).
    pub fn batch_norm2d(&mut self, prefix: &str, bn: &BatchNorm2d, x: &str) -> Result<String> {
        let scale = self.param(&format!("{prefix}.weight"), &bn.weight, true)?;
        let bias = self.param(&format!("{prefix}.bias"), &bn.bias, true)?;
        let mean = self.param(&format!("{prefix}.running_mean"), &bn.running_mean, true)?;
        let var = self.param(&format!("{prefix}.running_var"), &bn.running_var, true)?;
        Ok(self.node(
            "BatchNormalization",
            prefix,
            &[x, &scale, &bias, &mean, &var],
            vec![attr_float("epsilon", bn.eps as f32)],
        ))
    }

    /// `Gemm(x, W, b, transB=1)`: a Linear layer on `[N, in]` inputs.
    pub fn gemm(&mut self, prefix: &str, l: &Linear, x: &str) -> Result<String> {
        let w = self.param(&format!("{prefix}.weight"), &l.weight, false)?;
        let mut inputs = vec![x.to_string(), w];
        if let Some(b) = &l.bias {
            inputs.push(self.param(&format!("{prefix}.bias"), b, false)?);
        }
        let inputs: Vec<&str> = inputs.iter().map(String::as_str).collect();
        Ok(self.node("Gemm", prefix, &inputs, vec![attr_int("transB", 1)]))
    }

    /// `MatMul(x, Transpose(W)) + b`: a Linear layer on inputs of any rank (`Gemm` takes
    /// rank 2 only). The weight stays the checkpoint's `[out, in]` tensor; onnxruntime folds
    /// the `Transpose` when it loads the file.
    pub fn linear(&mut self, prefix: &str, l: &Linear, x: &str) -> Result<String> {
        let w = self.param(&format!("{prefix}.weight"), &l.weight, false)?;
        let wt = self.node(
            "Transpose",
            &format!("{prefix}.weight_t"),
            &[&w],
            vec![attr_ints("perm", &[1, 0])],
        );
        let y = self.node("MatMul", &format!("{prefix}.matmul"), &[x, &wt], vec![]);
        match &l.bias {
            Some(b) => {
                let b = self.param(&format!("{prefix}.bias"), b, false)?;
                Ok(self.node("Add", prefix, &[&y, &b], vec![]))
            }
            None => Ok(y),
        }
    }

    /// `LayerNormalization` over the layer's trailing dims.
    pub fn layer_norm(&mut self, prefix: &str, ln: &LayerNorm, x: &str) -> Result<String> {
        let scale = self.param(&format!("{prefix}.weight"), &ln.weight, true)?;
        let bias = self.param(&format!("{prefix}.bias"), &ln.bias, true)?;
        let axis = -(ln.normalized_shape.len() as i64);
        Ok(self.node(
            "LayerNormalization",
            prefix,
            &[x, &scale, &bias],
            vec![attr_int("axis", axis), attr_float("epsilon", ln.eps as f32)],
        ))
    }

    /// `Gather(weight, ids)`: the rows of an embedding table.
    pub fn embedding(&mut self, prefix: &str, e: &Embedding, ids: &str) -> Result<String> {
        let w = self.param(&format!("{prefix}.weight"), &e.weight, false)?;
        Ok(self.node("Gather", prefix, &[&w, ids], vec![attr_int("axis", 0)]))
    }

    /// `MaxPool` (floor mode, as hemi's).
    pub fn max_pool2d(&mut self, hint: &str, p: &MaxPool2d, x: &str) -> Result<String> {
        if p.kernel.0 == 0 || p.kernel.1 == 0 {
            return Err(Error::arg("onnx export", "max-pool kernel of size 0"));
        }
        let (ph, pw) = (p.padding.0 as i64, p.padding.1 as i64);
        Ok(self.node(
            "MaxPool",
            hint,
            &[x],
            vec![
                attr_ints("kernel_shape", &[p.kernel.0 as i64, p.kernel.1 as i64]),
                attr_ints("strides", &[p.stride.0 as i64, p.stride.1 as i64]),
                attr_ints("pads", &[ph, pw, ph, pw]),
            ],
        ))
    }

    /// `Relu`.
    pub fn relu(&mut self, hint: &str, x: &str) -> String {
        self.node("Relu", hint, &[x], vec![])
    }
}
