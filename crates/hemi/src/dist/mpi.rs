//! The MPI transport (cargo feature `mpi`): Open MPI or any MPI 3 library, through the `mpi`
//! crate.
//!
//! Only point-to-point messages are MPI's here (`MPI_Isend` + `MPI_Irecv` of bytes on
//! `MPI_COMM_WORLD`); the collectives are hemi's ([`super::ring`]). The pair is polled with
//! `MPI_Testall`, yielding and then sleeping between polls (20 µs doubling to 1 ms), so a rank
//! waiting for a slower peer does not spin a core the training threads need, and so that the
//! wait has a deadline: a peer silent for longer than the group's timeout ends the job
//! through `MPI_Abort` with a message naming both ranks (a pending MPI request cannot be
//! abandoned safely). A peer that dies is noticed by the MPI runtime itself, which ends the
//! job (`mpirun` names the rank and the signal).
//!
//! MPI is initialised on the communication thread with `MPI_THREAD_MULTIPLE` (only that
//! thread communicates; [`abort`] may be called from any thread) and finalised when the
//! [`super::ProcessGroup`] drops.

use std::os::raw::{c_int, c_void};
use std::time::{Duration, Instant};

use mpi::ffi;
use mpi::topology::Communicator;
use mpi::Threading;

use super::{ring, CommStats, ProcessGroup, Transport};
use crate::error::{Error, Result};

const TAG: c_int = 0x4845; // "HE"

/// One rank of an MPI job.
pub struct MpiTransport {
    rank: usize,
    size: usize,
    /// Where each rank runs ([`this_host`]), once exchanged; empty before.
    hosts: Vec<String>,
    _universe: mpi::environment::Universe,
}

/// This process's host as the other ranks should name it: MPI's processor name (the host
/// name), and the address of Open MPI's daemon on this host (`OMPI_MCA_orte_local_daemon_uri`,
/// `…;tcp://10.0.0.7:41234`: the address the job reaches this host at), when there is one:
/// `"node7 (10.0.0.7)"`. That variable is what the launcher tells its ranks, not a setting:
/// it only labels a rank in messages and changes no computation.
pub fn this_host() -> String {
    let name = mpi::environment::processor_name().unwrap_or_else(|_| "?".into());
    match std::env::var("OMPI_MCA_orte_local_daemon_uri")
        .ok()
        .and_then(|uri| daemon_address(&uri))
    {
        Some(addr) => format!("{name} ({addr})"),
        None => name,
    }
}

/// The address(es) in an Open MPI contact URI: `"1039138816.1;tcp://10.78.0.2:44371"` →
/// `"10.78.0.2"` (several addresses stay comma-separated, as Open MPI lists them). Public
/// for the MPI suite's test of it (the library builds no unit tests: `[lib] test = false`).
#[doc(hidden)]
pub fn daemon_address(uri: &str) -> Option<String> {
    let tcp = uri.split(';').find_map(|p| p.strip_prefix("tcp://"))?;
    let (addr, _port) = tcp.rsplit_once(':')?;
    (!addr.is_empty()).then(|| addr.to_string())
}

/// Whether this process was started by an MPI launcher (`mpirun`, `mpiexec`, `srun`): the
/// environment variables Open MPI, MPICH/PMI and PMIx set.
pub fn launched_by_mpirun() -> bool {
    [
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "PMIX_RANK",
        "MV2_COMM_WORLD_SIZE",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some())
}

impl MpiTransport {
    /// Initialises MPI (on the calling thread).
    pub fn init() -> Result<MpiTransport> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| Error::Msg("MPI is already initialised in this process".into()))?;
        if threading < Threading::Serialized {
            return Err(Error::Msg(format!(
                "the MPI library provides thread level {threading:?}; hemi needs at least \
                 MPI_THREAD_SERIALIZED (its communication runs on a thread of its own)"
            )));
        }
        let world = universe.world();
        Ok(MpiTransport {
            rank: world.rank() as usize,
            size: world.size() as usize,
            hosts: Vec::new(),
            _universe: universe,
        })
    }

    /// Tells every rank where every other rank runs ([`this_host`]), for the messages that
    /// name a rank's host.
    fn exchange_hosts(&mut self, timeout: Duration) -> Result<()> {
        let all = ring::all_gather(
            self,
            this_host().into_bytes(),
            &CommStats::default(),
            timeout,
        )?;
        self.hosts = all
            .into_iter()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .collect();
        Ok(())
    }

    /// `rank R on host H`, or `rank R` before the hosts are known.
    fn who(&self, rank: usize) -> String {
        match self.hosts.get(rank) {
            Some(h) => format!("rank {rank} on host {h}"),
            None => format!("rank {rank}"),
        }
    }
}

/// A process group over `MPI_COMM_WORLD` (MPI initialised on its communication thread).
pub fn process_group(timeout: Duration) -> Result<ProcessGroup> {
    ProcessGroup::start(
        move || {
            let mut t = MpiTransport::init()?;
            t.exchange_hosts(timeout)?;
            Ok(Box::new(t) as Box<dyn Transport>)
        },
        timeout,
        Some(abort),
    )
}

/// Ends every rank of the job with `code` (`MPI_Abort`).
pub fn abort(code: i32) {
    // SAFETY: MPI is initialised with MPI_THREAD_MULTIPLE before any group exists.
    unsafe {
        ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code);
    }
}

fn count(len: usize, what: &str) -> Result<c_int> {
    c_int::try_from(len).map_err(|_| {
        Error::Msg(format!(
            "an MPI message of {len} bytes ({what}) exceeds MPI's 2^31 − 1 count"
        ))
    })
}

impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn hosts(&self) -> Vec<String> {
        self.hosts.clone()
    }

    fn size(&self) -> usize {
        self.size
    }

    fn sendrecv(
        &mut self,
        send: &[u8],
        dst: usize,
        recv: &mut [u8],
        src: usize,
        timeout: Duration,
    ) -> Result<()> {
        let (ns, nr) = (count(send.len(), "send")?, count(recv.len(), "receive")?);
        // SAFETY: both buffers outlive the requests, which are completed below before
        // returning (or the process is aborted).
        let mut reqs: [ffi::MPI_Request; 2] = unsafe { [ffi::RSMPI_REQUEST_NULL; 2] };
        let mut statuses: [std::mem::MaybeUninit<ffi::MPI_Status>; 2] = [
            std::mem::MaybeUninit::uninit(),
            std::mem::MaybeUninit::uninit(),
        ];
        unsafe {
            ffi::MPI_Irecv(
                recv.as_mut_ptr() as *mut c_void,
                nr,
                ffi::RSMPI_UINT8_T,
                src as c_int,
                TAG,
                ffi::RSMPI_COMM_WORLD,
                &mut reqs[0],
            );
            ffi::MPI_Isend(
                send.as_ptr() as *const c_void,
                ns,
                ffi::RSMPI_UINT8_T,
                dst as c_int,
                TAG,
                ffi::RSMPI_COMM_WORLD,
                &mut reqs[1],
            );
        }
        let start = Instant::now();
        let (mut polls, mut nap) = (0u32, Duration::from_micros(20));
        loop {
            let mut flag: c_int = 0;
            unsafe {
                ffi::MPI_Testall(
                    2,
                    reqs.as_mut_ptr(),
                    &mut flag,
                    statuses.as_mut_ptr() as *mut ffi::MPI_Status,
                );
            }
            if flag != 0 {
                break;
            }
            if start.elapsed() > timeout {
                let peers = if src == dst {
                    format!("{} (or it is not receiving)", self.who(src))
                } else {
                    format!("{} (or {} not receiving)", self.who(src), self.who(dst))
                };
                eprintln!(
                    "hemi: rank {}: no message from {peers} within {:.0} s: a rank has died or \
                     hangs, or its host is unreachable; aborting the job",
                    self.rank,
                    timeout.as_secs_f64()
                );
                abort(3);
            }
            polls += 1;
            if polls < 200 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(1));
            }
        }
        let mut got: c_int = 0;
        // SAFETY: MPI_Testall filled both statuses when it set the flag.
        unsafe {
            ffi::MPI_Get_count(statuses[0].as_ptr(), ffi::RSMPI_UINT8_T, &mut got);
        }
        if got != nr {
            return Err(Error::Msg(format!(
                "rank {}: rank {src} sent {got} bytes where {nr} were expected (the ranks are \
                 out of step: different models or settings?)",
                self.rank
            )));
        }
        Ok(())
    }
}
