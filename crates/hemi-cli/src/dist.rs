//! `mpirun -np N hemi train …`: the process group of an MPI launch (cargo feature `mpi`).

use std::sync::Arc;
use std::time::Duration;

use hemi::dist::ProcessGroup;
use hemi::{Error, Result};

/// The ranks an MPI launcher announced in the environment (Open MPI, MPICH/PMI, MVAPICH),
/// if any.
#[cfg_attr(feature = "mpi", allow(dead_code))]
fn launched_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
}

/// The group of this MPI job, or `None` for a plain run (no launcher, or one rank).
#[cfg(feature = "mpi")]
pub fn setup(timeout: Duration) -> Result<Option<Arc<ProcessGroup>>> {
    if !hemi::dist::mpi::launched_by_mpirun() {
        return Ok(None);
    }
    let group = hemi::dist::mpi::process_group(timeout)?;
    if group.size() == 1 {
        return Ok(None);
    }
    if group.rank() != 0 {
        silence_stdout();
    }
    Ok(Some(Arc::new(group)))
}

/// Without MPI support a launch by `mpirun` would train N independent copies: refuse.
#[cfg(not(feature = "mpi"))]
pub fn setup(_timeout: Duration) -> Result<Option<Arc<ProcessGroup>>> {
    match launched_size() {
        Some(n) if n > 1 => Err(Error::Msg(format!(
            "started by an MPI launcher with {n} ranks, but this hemi was built without MPI \
             support; build it with `cargo build --release --features mpi` (needs an MPI \
             library, e.g. Debian's libopenmpi-dev)"
        ))),
        _ => Ok(None),
    }
}

/// Ranks other than 0 print nothing on stdout (rank 0 reports the run); errors still go to
/// stderr, prefixed with the rank.
#[cfg(feature = "mpi")]
fn silence_stdout() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::fd::AsRawFd;
        if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
            // SAFETY: dup2 onto stdout's descriptor; `null` stays open until then.
            unsafe {
                libc::dup2(null.as_raw_fd(), libc::STDOUT_FILENO);
            }
        }
    }
}

/// Where the ranks run, for the start of the report: `hosts: all 2 ranks on node7
/// (10.0.0.7)` or `hosts: rank 0 on node7 (10.0.0.7), rank 1 on node8 (10.0.0.8)`; `None`
/// where the transport does not know.
pub fn hosts_line(hosts: &[String]) -> Option<String> {
    let first = hosts.first()?;
    Some(if hosts.iter().all(|h| h == first) {
        format!("hosts: all {} ranks on {first}", hosts.len())
    } else {
        let each: Vec<String> = (hosts.iter().enumerate())
            .map(|(r, h)| format!("rank {r} on {h}"))
            .collect();
        format!("hosts: {}", each.join(", "))
    })
}

/// The cores of this machine divided among the ranks the launcher started on it (Open
/// MPI's `OMPI_COMM_WORLD_LOCAL_SIZE`, MPICH's `MPI_LOCALNRANKS`), at least 1.
pub fn threads_per_rank() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let local = ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse::<usize>().ok())
        .unwrap_or(1);
    (cores / local.max(1)).max(1)
}

/// `rank:step` from `HEMI_DEBUG_INJECT_INF`: that rank's gradients become inf at that global
/// step (1-based), to check that every rank skips together.
pub fn inject_inf() -> Result<Option<(usize, u64)>> {
    let Ok(v) = std::env::var("HEMI_DEBUG_INJECT_INF") else {
        return Ok(None);
    };
    let bad = || {
        Error::Msg(format!(
            "HEMI_DEBUG_INJECT_INF={v:?}: expected RANK:STEP, e.g. 1:3"
        ))
    };
    let (r, s) = v.split_once(':').ok_or_else(bad)?;
    Ok(Some((
        r.trim().parse().map_err(|_| bad())?,
        s.trim().parse().map_err(|_| bad())?,
    )))
}

/// Reports `e` as this rank's error, then ends the whole job (`MPI_Abort`), so that the other
/// ranks do not wait for this one until their deadline.
pub fn fail(group: &ProcessGroup, e: &Error) {
    use std::io::Write;
    let msg = e.to_string();
    let prefix = format!("rank {}", group.rank());
    if msg.starts_with(&prefix) {
        eprintln!("error: {msg}");
    } else {
        eprintln!("error: {prefix}: {msg}");
    }
    let _ = std::io::stderr().flush();
    // A moment for the other ranks to print their own error when they met the same one (a
    // mismatch found at start is found by every rank).
    std::thread::sleep(Duration::from_millis(500));
    group.abort(1);
}
