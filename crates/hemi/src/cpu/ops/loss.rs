//! `LossOps` on the CPU: the targets read and checked, the inputs read in the compute type,
//! the losses of `cpu::reduce::loss`, each result rounded once into the dtype asked for.

use crate::backend::loss::{ClassLoss, ClassLossForward, ClassSaved, LossOps, Reduction};
use crate::backend::nn::View;
use crate::backend::reduce::Rows;
use crate::cpu::reduce::loss::{class_loss, class_loss_grads, mse, mse_grads};
use crate::cpu::storage::CpuStorage;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Layout;

/// The target of each row: `None` where it is the ignore index, the class otherwise; a
/// target outside `0..classes` is `Error::Index`.
fn targets_of(
    target: &CpuStorage,
    lt: &Layout,
    loss: &ClassLoss,
    classes: usize,
) -> Result<Vec<Option<usize>>> {
    target
        .to_i64(lt)
        .iter()
        .map(|&t| {
            if Some(t) == loss.ignore_index {
                Ok(None)
            } else if (0..classes as i64).contains(&t) {
                Ok(Some(t as usize))
            } else {
                Err(Error::Index {
                    op: loss.op,
                    index: t,
                    size: classes,
                })
            }
        })
        .collect()
}

impl LossOps for CpuStorage {
    fn class_loss(
        &self,
        layout: &Layout,
        target: &Self,
        lt: &Layout,
        rows: Rows,
        loss: ClassLoss,
        out: DType,
    ) -> Result<ClassLossForward<Self>> {
        let targets = targets_of(target, lt, &loss, rows.len)?;
        let counted = targets.iter().filter(|t| t.is_some()).count();
        Ok(crate::with_compute!(out, C => {
            let xv = self.load::<C>(layout);
            let (reduced, lp) = class_loss(&xv, &targets, counted, rows, &loss);
            ClassLossForward {
                loss: CpuStorage::store::<C>(reduced, out),
                log_probs: lp.map(|lp| CpuStorage::store::<C>(lp, out)),
                counted,
            }
        }))
    }

    fn class_loss_backward(
        &self,
        lg: &Layout,
        ClassSaved { log_probs, counted }: ClassSaved<'_, Self>,
        (target, lt): View<'_, Self>,
        rows: Rows,
        loss: ClassLoss,
        out: DType,
    ) -> Result<Self> {
        let targets = targets_of(target, lt, &loss, rows.len)?;
        Ok(crate::with_compute!(out, C => {
            let lp = log_probs.map(|s| s.load::<C>(&Layout::contiguous(&[s.len()])));
            let gv = self.load::<C>(lg);
            let gi = class_loss_grads(&gv, lp.as_deref(), &targets, counted, rows, &loss);
            CpuStorage::store::<C>(gi, out)
        }))
    }

    fn mse(
        &self,
        la: &Layout,
        target: &Self,
        lb: &Layout,
        reduction: Reduction,
        out: DType,
    ) -> Result<(Self, Self)> {
        Ok(crate::with_compute!(out, C => {
            let (loss, diff) = mse(&self.load::<C>(la), &target.load::<C>(lb), reduction);
            (CpuStorage::store::<C>(loss, out), CpuStorage::store::<C>(diff, out))
        }))
    }

    fn mse_backward(
        &self,
        g: &Self,
        lg: &Layout,
        reduction: Reduction,
        out: DType,
    ) -> Result<(Self, Self)> {
        Ok(crate::with_compute!(out, C => {
            let diff = self.load::<C>(&Layout::contiguous(&[self.len()]));
            let (da, db) = mse_grads(&diff, &g.load::<C>(lg), reduction);
            (CpuStorage::store::<C>(da, out), CpuStorage::store::<C>(db, out))
        }))
    }
}
