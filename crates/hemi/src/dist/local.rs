//! Ranks as threads of one process, connected by channels: the transport of the tests (and
//! of anyone who wants data parallelism without MPI on one machine).

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use super::Transport;
use crate::error::{Error, Result};

/// One rank's end of a group of threads ([`LocalTransport::group`]).
pub struct LocalTransport {
    rank: usize,
    to: Vec<Sender<Vec<u8>>>,
    from: Vec<Receiver<Vec<u8>>>,
}

impl LocalTransport {
    /// `n` connected ranks; hand one to each thread.
    pub fn group(n: usize) -> Vec<LocalTransport> {
        // channels[src][dst]
        let mut senders: Vec<Vec<Option<Sender<Vec<u8>>>>> = (0..n).map(|_| Vec::new()).collect();
        let mut receivers: Vec<Vec<Option<Receiver<Vec<u8>>>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        for (src, row) in senders.iter_mut().enumerate() {
            for rx_row in receivers.iter_mut() {
                let (tx, rx) = channel();
                row.push(Some(tx));
                rx_row[src] = Some(rx);
            }
        }
        (0..n)
            .map(|r| LocalTransport {
                rank: r,
                to: senders[r]
                    .iter_mut()
                    .map(|s| s.take().expect("once"))
                    .collect(),
                from: receivers[r]
                    .iter_mut()
                    .map(|s| s.take().expect("once"))
                    .collect(),
            })
            .collect()
    }
}

impl Transport for LocalTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.to.len()
    }

    fn sendrecv(
        &mut self,
        send: &[u8],
        dst: usize,
        recv: &mut [u8],
        src: usize,
        timeout: Duration,
    ) -> Result<()> {
        let r = self.rank;
        self.to[dst].send(send.to_vec()).map_err(|_| {
            Error::Msg(format!(
                "rank {r}: rank {dst} has gone (its end of the group was dropped)"
            ))
        })?;
        let got = self.from[src].recv_timeout(timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => Error::Msg(format!(
                "rank {r}: no message from rank {src} within {:.1} s (it has died or hangs)",
                timeout.as_secs_f64()
            )),
            RecvTimeoutError::Disconnected => Error::Msg(format!(
                "rank {r}: rank {src} has gone (its end of the group was dropped)"
            )),
        })?;
        if got.len() != recv.len() {
            return Err(Error::Msg(format!(
                "rank {r}: rank {src} sent {} bytes where {} were expected (the ranks are out \
                 of step)",
                got.len(),
                recv.len()
            )));
        }
        recv.copy_from_slice(&got);
        Ok(())
    }
}
