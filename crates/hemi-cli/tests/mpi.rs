//! `mpirun -np 2 hemi train …` end to end (a build with `--features mpi` and Open MPI's
//! `mpirun` on PATH; `.ci/run` installs it): 2 ranks × batch B against 1 rank × batch 2B,
//! the half-precision wire, an inf on one rank, resume, a killed or hanging rank, ranks
//! started with different settings, ZeRO stages 1 and 2 against plain data parallel, and
//! two "hosts" with network stacks of their own (Linux network namespaces, TCP between
//! them; root and iproute2, else SKIPPED, or a failure under `HEMI_REQUIRE_NETNS=1`): the
//! same bits as one host, and a host that vanishes from the network.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use hemi::train::load_checkpoint;

#[allow(dead_code)] // this file runs its commands through mpirun, not `hemi()`
mod common;
use common::ok;

/// `mpirun` with whatever this container needs (root, more ranks than cores).
fn mpirun() -> Command {
    let mut c = Command::new("mpirun");
    c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        // No network interfaces to probe in a container: shared memory and loopback only.
        .env("OMPI_MCA_btl", "self,vader,tcp")
        .env("OMPI_MCA_btl_tcp_if_include", "lo")
        .env("OMPI_MCA_oob_tcp_if_include", "lo")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1");
    c
}

const HEMI: &str = env!("CARGO_BIN_EXE_hemi");

/// The training flags every run here shares: a small MLP on the built-in synthetic set.
fn train_args(ckpt: &Path, batch: usize, precision: &str) -> Vec<String> {
    [
        "train",
        "--model",
        "mlp",
        "--dataset",
        "synthetic",
        "--synthetic-size",
        "512",
        "--epochs",
        "2",
        "--lr",
        "0.05",
        "--threads",
        "1",
        "--workers",
        "1",
        "--log-every",
        "4",
        "--quiet",
        "--precision",
        precision,
        "--batch-size",
        &batch.to_string(),
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Runs `cmd`, killing it (and failing) if it takes longer than `limit`.
fn run_bounded(mut cmd: Command, limit: Duration) -> (Output, Duration) {
    let start = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start mpirun (is Open MPI installed? .ci/run installs it)");
    loop {
        if child.try_wait().unwrap().is_some() {
            return (child.wait_with_output().unwrap(), start.elapsed());
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let o = child.wait_with_output().unwrap();
            panic!(
                "still running after {limit:?} (a hang):\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn two_ranks(args: &[String], env: &[(&str, &str)]) -> Output {
    n_ranks(2, args, env)
}

fn n_ranks(n: usize, args: &[String], env: &[(&str, &str)]) -> Output {
    let mut c = mpirun();
    c.args(["-np", &n.to_string(), HEMI]).args(args);
    for (k, v) in env {
        // mpirun passes its environment on to the ranks it starts on this machine.
        c.env(k, v);
    }
    run_bounded(c, Duration::from_secs(300)).0
}

fn one_rank(args: &[String]) -> Output {
    let mut c = Command::new(HEMI);
    c.args(args);
    run_bounded(c, Duration::from_secs(300)).0
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hemi-mpi-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The final weights of a run, as F32 values per tensor (names checked equal).
fn weights(ckpt: &Path) -> Vec<(String, Vec<f32>)> {
    let ck = load_checkpoint(ckpt).unwrap();
    ck.model
        .iter()
        .map(|(n, t)| {
            let t = t.to_dtype(hemi::DType::F32).unwrap();
            (n.clone(), t.to_vec_f32())
        })
        .collect()
}

fn model_bytes(ckpt: &Path, epoch: usize) -> Vec<u8> {
    std::fs::read(ckpt.join(format!("epoch-{epoch:04}/model.safetensors"))).unwrap()
}

#[test]
fn two_ranks_train_exactly_like_one_rank_with_twice_the_batch() {
    for precision in ["fp32", "amp-fp16"] {
        let (a, b) = (
            tmp(&format!("a-{precision}")),
            tmp(&format!("b-{precision}")),
        );
        let out = ok(&two_ranks(&train_args(&a, 16, precision), &[]));
        assert!(
            out.contains("2 ranks x batch 16 = global batch 32"),
            "{out}"
        );
        // Only rank 0 reports: one summary line.
        assert_eq!(out.matches("Finished Training").count(), 1, "{out}");
        let mut args = train_args(&b, 32, precision);
        args.extend(["--micro-batches".into(), "2".into()]);
        ok(&one_rank(&args));
        for epoch in [1, 2] {
            assert!(
                model_bytes(&a, epoch) == model_bytes(&b, epoch),
                "{precision}: after epoch {epoch}, 2 ranks x 16 and 1 rank x 32 differ"
            );
        }
    }
}

#[test]
fn half_precision_all_reduce_stays_within_its_rounding() {
    let (a, b) = (tmp("f32-wire"), tmp("f16-wire"));
    ok(&two_ranks(&train_args(&a, 16, "fp32"), &[]));
    let mut args = train_args(&b, 16, "fp32");
    args.extend(["--allreduce".into(), "f16".into()]);
    let out = ok(&two_ranks(&args, &[]));
    assert!(out.contains("all-reduce in f16"), "{out}");
    let rel = |e: usize| -> f64 {
        let dir = |d: &Path| d.join(format!("epoch-{e:04}"));
        let (x, y) = (weights(&dir(&a)), weights(&dir(&b)));
        let (mut d, mut s) = (0.0, 0.0);
        for ((n, p), (m, q)) in x.iter().zip(&y) {
            assert_eq!(n, m);
            d += p
                .iter()
                .zip(q)
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum::<f64>();
            s += p.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>();
        }
        (d / s).sqrt()
    };
    let (r1, r2) = (rel(1), rel(2));
    eprintln!("F16 wire: relative distance of the weights {r1:e} after epoch 1, {r2:e} after 2");
    // Each step rounds the gradient twice to F16 (2^-11; the library's dist tests bound one
    // step); momentum SGD at lr 0.05 then amplifies the difference, which grows about 40x in
    // the second epoch (measured on Zen 3: 1.3e-4 after 16 steps, 5.3e-3 after 32).
    assert!(
        r1 < 1e-3,
        "the F16 wire moved the weights by {r1:e} in 16 steps"
    );
    assert!(
        r2 < 3e-2,
        "the F16 wire moved the weights by {r2:e} in 32 steps"
    );
    let moved = r1 > 0.0;
    assert!(moved, "the F16 wire changed nothing: was it used?");
    // F16 halves the bytes sent.
    let mb = |o: &str| -> f64 {
        let i = o.find("communication (rank 0): ").unwrap() + 24;
        o[i..].split(' ').next().unwrap().parse().unwrap()
    };
    let f32_out = ok(&two_ranks(&train_args(&tmp("f32-wire-2"), 16, "fp32"), &[]));
    let ratio = mb(&out) / mb(&f32_out);
    assert!(
        (0.45..0.55).contains(&ratio),
        "F16/F32 bytes per step: {ratio}"
    );
}

#[test]
fn an_inf_on_one_rank_makes_both_ranks_skip_the_step() {
    let a = tmp("inf");
    let out = ok(&two_ranks(
        &train_args(&a, 16, "amp-fp16"),
        &[("HEMI_DEBUG_INJECT_INF", "1:3")],
    ));
    // Rank 0 had finite gradients; it skipped because rank 1 did. Had the ranks disagreed,
    // their parameters would differ and the end-of-epoch replica check would have failed.
    assert!(out.contains("1 of 32 steps skipped"), "{out}");
    let ck = load_checkpoint(&a).unwrap();
    let scale = ck.scaler.expect("amp-fp16 saves the scaler").get("scale");
    assert_eq!(scale, Some(32768.0), "the scale backed off once");
}

#[test]
fn a_resumed_two_rank_run_ends_bit_identical() {
    let (whole, parts) = (tmp("whole"), tmp("parts"));
    ok(&two_ranks(&train_args(&whole, 16, "amp-bf16"), &[]));
    let mut first = train_args(&parts, 16, "amp-bf16");
    first.extend(["--stop-after".into(), "1".into()]);
    ok(&two_ranks(&first, &[]));
    let mut rest = train_args(&parts, 16, "amp-bf16");
    rest.push("--resume".into());
    let out = ok(&two_ranks(&rest, &[]));
    assert!(out.contains("resuming at epoch 2"), "{out}");
    assert!(model_bytes(&whole, 2) == model_bytes(&parts, 2));
}

/// `mpirun -np 2 sh -c '…'`: rank 1 runs `then` on itself (its PID is the shell's, which
/// `exec`s hemi) after `after` seconds.
fn with_rank1_signal(signal: &str, after: f64, extra: &[&str]) -> (Output, Duration) {
    let ckpt = tmp(&format!("sig-{signal}"));
    let mut args = train_args(&ckpt, 16, "fp32");
    // Long enough that the signal lands mid-training.
    assert_eq!(
        (args[5].as_str(), args[7].as_str()),
        ("--synthetic-size", "--epochs")
    );
    args[6] = "8192".into();
    args[8] = "50".into();
    args.extend(extra.iter().map(|s| s.to_string()));
    let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
    let script = format!(
        "if [ \"$OMPI_COMM_WORLD_RANK\" = 1 ]; then (sleep {after}; kill -{signal} $$) & fi; \
         exec '{HEMI}' {}",
        quoted.join(" ")
    );
    let mut c = mpirun();
    c.args(["-np", "2", "sh", "-c", &script]);
    run_bounded(c, Duration::from_secs(120))
}

#[test]
fn a_killed_rank_ends_the_job_with_an_error_not_a_hang() {
    let (o, took) = with_rank1_signal("KILL", 3.0, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("rank 1") || err.contains("signal 9"),
        "the error should name the rank: {err}"
    );
    assert!(took < Duration::from_secs(60), "took {took:?}");
}

#[test]
fn a_hanging_rank_ends_the_job_after_the_timeout() {
    let (o, took) = with_rank1_signal("STOP", 3.0, &["--dist-timeout", "4"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("rank 0: no message from rank 1"),
        "the error should name both ranks: {err}"
    );
    assert!(took < Duration::from_secs(60), "took {took:?}");
}

#[test]
fn ranks_started_with_different_settings_are_named_at_start() {
    let ckpt = tmp("mismatch");
    let a = train_args(&ckpt, 16, "fp32");
    let mut b = a.clone();
    assert_eq!(a[9], "--lr");
    b[10] = "0.1".into();
    let mut c = mpirun();
    c.args(["-np", "1", HEMI])
        .args(&a)
        .arg(":")
        .args(["-np", "1", HEMI])
        .args(&b);
    let (o, took) = run_bounded(c, Duration::from_secs(120));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("lr") && err.contains("rank"), "{err}");
    assert!(took < Duration::from_secs(60), "took {took:?}");
    // Nothing was trained or written.
    assert!(!ckpt.join("epoch-0001").exists());
}

#[test]
fn sync_batch_norm_trains_a_resnet_on_two_ranks() {
    let ckpt = tmp("sync-bn");
    let mut args = train_args(&ckpt, 8, "amp-bf16");
    args[2] = "resnet20".into();
    args[6] = "64".into();
    args[8] = "1".into();
    args.push("--sync-bn".into());
    let out = ok(&two_ranks(&args, &[]));
    assert!(out.contains("SyncBatchNorm: 19 batch norms"), "{out}");
    // The replicas' parameters are compared after every epoch: equal, or the run fails.
    let ck = load_checkpoint(&ckpt).unwrap();
    assert_eq!(
        ck.info.settings.get("sync_bn").map(String::as_str),
        Some("true")
    );
}

/// The files of a checkpoint that must not depend on the ZeRO stage: the weights, the
/// optimizer state's buffers, and state.json without the run's settings (which record the
/// stage).
fn checkpoint_files(ckpt: &Path, epoch: usize) -> (Vec<u8>, Vec<u8>, serde_json::Value) {
    let dir = ckpt.join(format!("epoch-{epoch:04}"));
    let read = |f: &str| std::fs::read(dir.join(f)).unwrap();
    let mut state: serde_json::Value = serde_json::from_slice(&read("state.json")).unwrap();
    state["run"]["settings"] = serde_json::Value::Null;
    (
        read("model.safetensors"),
        read("optimizer.safetensors"),
        state,
    )
}

/// `args` with `extra` added; a flag already in `args` (`--lr`) has its value replaced.
fn with_args(mut args: Vec<String>, extra: &[&str]) -> Vec<String> {
    let mut i = 0;
    while i < extra.len() {
        let value = extra.get(i + 1).filter(|v| !v.starts_with("--"));
        match (args.iter().position(|a| a == extra[i]), value) {
            (Some(at), Some(v)) => {
                args[at + 1] = v.to_string();
                i += 2;
            }
            (None, Some(v)) => {
                args.extend([extra[i].to_string(), v.to_string()]);
                i += 2;
            }
            (_, None) => {
                args.push(extra[i].to_string());
                i += 1;
            }
        }
    }
    args
}

#[test]
fn zero_1_and_2_write_the_checkpoints_of_plain_data_parallel_byte_for_byte() {
    let recipes: [(usize, &str, &[&str]); 4] = [
        (2, "fp32", &[]),
        (
            2,
            "amp-fp16",
            &[
                "--optimizer",
                "adam",
                "--lr",
                "0.001",
                "--clip-grad-norm",
                "0.5",
            ],
        ),
        (
            2,
            "fp16-master",
            &[
                "--optimizer",
                "adamw",
                "--lr",
                "0.001",
                "--clip-grad-norm",
                "0.5",
            ],
        ),
        (
            3,
            "amp-fp16",
            &[
                "--optimizer",
                "adam",
                "--lr",
                "0.001",
                "--clip-grad-norm",
                "0.5",
            ],
        ),
    ];
    for (ranks, precision, extra) in recipes {
        let name = format!("{ranks}-{precision}-{}", extra.len());
        let run = |zero: &str| {
            let dir = tmp(&format!("zero{zero}-{name}"));
            // Small buckets (64 KiB): chunk boundaries cut the MLP's parameters.
            let args = with_args(
                train_args(&dir, 16, precision),
                &[&["--zero", zero, "--bucket-mb", "0.0625"][..], extra].concat(),
            );
            let out = ok(&n_ranks(ranks, &args, &[]));
            (dir, out)
        };
        let (plain, _) = run("0");
        for zero in ["1", "2"] {
            let (dir, out) = run(zero);
            assert!(out.contains(&format!("ZeRO stage {zero}")), "{out}");
            for epoch in [1, 2] {
                let (a, b) = (
                    checkpoint_files(&plain, epoch),
                    checkpoint_files(&dir, epoch),
                );
                assert!(
                    a.0 == b.0,
                    "{name} zero {zero} epoch {epoch}: the weights differ"
                );
                assert!(
                    a.1 == b.1,
                    "{name} zero {zero} epoch {epoch}: the optimizer state differs"
                );
                assert_eq!(
                    a.2, b.2,
                    "{name} zero {zero} epoch {epoch}: state.json differs"
                );
            }
            let ck = load_checkpoint(&dir).unwrap();
            assert_eq!(ck.info.settings.get("zero").map(String::as_str), Some(zero));
        }
    }
}

#[test]
fn a_resumed_zero_run_ends_bit_identical() {
    let extra = [
        "--zero",
        "2",
        "--optimizer",
        "adam",
        "--lr",
        "0.001",
        "--bucket-mb",
        "0.0625",
    ];
    let (whole, parts) = (tmp("zero-whole"), tmp("zero-parts"));
    ok(&two_ranks(
        &with_args(train_args(&whole, 16, "amp-fp16"), &extra),
        &[],
    ));
    let first = with_args(train_args(&parts, 16, "amp-fp16"), &extra);
    ok(&two_ranks(&with_args(first, &["--stop-after", "1"]), &[]));
    // The sharded run's checkpoint is in the usual format: plain data parallel continues it.
    let unsharded = tmp("zero-parts-0");
    std::fs::create_dir_all(unsharded.join("epoch-0001")).unwrap();
    for f in std::fs::read_dir(parts.join("epoch-0001")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(
            &f,
            unsharded.join("epoch-0001").join(f.file_name().unwrap()),
        )
        .unwrap();
    }
    let rest = with_args(train_args(&parts, 16, "amp-fp16"), &extra);
    let out = ok(&two_ranks(&with_args(rest, &["--resume"]), &[]));
    assert!(out.contains("resuming at epoch 2"), "{out}");
    let plain = with_args(train_args(&unsharded, 16, "amp-fp16"), &extra);
    ok(&two_ranks(
        &with_args(plain, &["--zero", "0", "--resume"]),
        &[],
    ));
    let (a, b) = (checkpoint_files(&whole, 2), checkpoint_files(&parts, 2));
    assert!(a.0 == b.0, "the weights differ");
    assert!(a.1 == b.1, "the optimizer state differs");
    let c = checkpoint_files(&unsharded, 2);
    assert!(a.0 == c.0, "resumed without ZeRO, the weights differ");
    assert!(
        a.1 == c.1,
        "resumed without ZeRO, the optimizer state differs"
    );
}

#[test]
fn resuming_a_zero_run_on_another_rank_count_names_both_counts() {
    let extra = ["--zero", "1", "--optimizer", "adam", "--lr", "0.001"];
    let dir = tmp("zero-ranks");
    let first = with_args(train_args(&dir, 16, "fp32"), &extra);
    ok(&two_ranks(&with_args(first, &["--stop-after", "1"]), &[]));
    let rest = with_args(
        with_args(train_args(&dir, 16, "fp32"), &extra),
        &["--resume"],
    );
    let o = n_ranks(3, &rest, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("on 2 rank(s) and this run has 3"),
        "the error should name both rank counts: {err}"
    );
    // Nothing was trained: the checkpoint of epoch 1 is still the newest.
    assert!(!dir.join("epoch-0002").exists());
}

/// Network namespaces of one test made into hosts: `{ns}0` and `{ns}1`, joined by a veth
/// pair (`eth0` in each, 10.78.0.1 and 10.78.0.2: the stacks are private, so every test can
/// use the same subnet), each with a hostname of its own (`{ns}-host0`…); Open MPI reaches
/// them through a remote-launch agent that enters the namespace where a cluster would ssh
/// (bench/multihost.sh does the same with a bridge and N hosts). Dropping it ends whatever
/// still runs in them and removes them.
struct Hosts {
    ns: String,
    dir: PathBuf,
}

const SUBNET: &str = "10.78.0";

fn ip(args: &[&str]) -> Result<(), String> {
    let o = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip` (install iproute2): {e}"))?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        ))
    }
}

impl Hosts {
    fn create(name: &str) -> Result<Hosts, String> {
        let ns = format!("hemi-{}-{name}", std::process::id());
        let hosts = Hosts {
            dir: tmp(&format!("hosts-{name}")),
            ns,
        };
        let (h0, h1) = (hosts.host(0), hosts.host(1));
        ip(&["netns", "add", &h0])?;
        ip(&["netns", "add", &h1])?;
        ip(&[
            "link", "add", "eth0", "netns", &h0, "type", "veth", "peer", "name", "eth0", "netns",
            &h1,
        ])?;
        for (i, h) in [&h0, &h1].into_iter().enumerate() {
            ip(&[
                "-n",
                h,
                "addr",
                "add",
                &format!("{SUBNET}.{}/24", i + 1),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", h, "link", "set", "eth0", "up"])?;
            ip(&["-n", h, "link", "set", "lo", "up"])?;
            // Give up on unacknowledged TCP data after 4 retransmissions (about 6 s) instead
            // of Linux's 15 (about 15 minutes): once the job is aborting, mpirun notices the
            // vanished host only when a send to its daemon fails (bench/multihost.sh, README).
            ip(&[
                "netns",
                "exec",
                h,
                "sh",
                "-c",
                "echo 4 > /proc/sys/net/ipv4/tcp_retries2",
            ])?;
        }
        std::fs::create_dir_all(&hosts.dir).map_err(|e| e.to_string())?;
        let agent = format!(
            "#!/bin/sh\nhost=$1; shift\nn=${{host##*.}}\nexec ip netns exec \"{}$((n - 1))\" \
             unshare --uts sh -c \"hostname {}-host$((n - 1)); $*\"\n",
            hosts.ns, hosts.ns
        );
        std::fs::write(hosts.agent(), agent).map_err(|e| e.to_string())?;
        std::fs::write(
            hosts.dir.join("hostfile"),
            format!("{SUBNET}.1 slots=1\n{SUBNET}.2 slots=1\n"),
        )
        .map_err(|e| e.to_string())?;
        let chmod = Command::new("chmod")
            .arg("+x")
            .arg(hosts.agent())
            .status()
            .map_err(|e| e.to_string())?;
        if !chmod.success() {
            return Err("chmod +x on the remote-launch agent failed".into());
        }
        Ok(hosts)
    }

    /// The namespace of host `i`.
    fn host(&self, i: usize) -> String {
        format!("{}{i}", self.ns)
    }

    /// Host `i` as the ranks name it: its hostname and address.
    fn named(&self, i: usize) -> String {
        format!("{}-host{i} ({SUBNET}.{})", self.ns, i + 1)
    }

    fn agent(&self) -> PathBuf {
        self.dir.join("netns-rsh")
    }

    /// `mpirun -np 2 hemi ARGS` started on host 0, one rank per host, over TCP on the
    /// hosts' subnet only (no shared memory between them).
    fn mpirun(&self, args: &[String]) -> Command {
        let mut c = Command::new("ip");
        c.args([
            "netns",
            "exec",
            &self.host(0),
            "unshare",
            "--uts",
            "sh",
            "-c",
        ])
        .arg(format!("hostname {}-host0; exec \"$0\" \"$@\"", self.ns))
        .arg("mpirun")
        .arg("--hostfile")
        .arg(self.dir.join("hostfile"))
        // Each host's daemon would bind its rank to its core 0: the same core here.
        .args(["-np", "2", "--bind-to", "none", "--mca", "plm_rsh_agent"])
        .arg(self.agent())
        .args(["--mca", "btl", "self,tcp"])
        .args(["--mca", "btl_tcp_if_include", &format!("{SUBNET}.0/24")])
        .args(["--mca", "oob_tcp_if_include", &format!("{SUBNET}.0/24")])
        .arg(HEMI)
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        c
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for i in 0..2 {
            let h = self.host(i);
            // Ranks and daemons a failure left behind, then the namespace.
            if let Ok(o) = Command::new("ip").args(["netns", "pids", &h]).output() {
                for pid in String::from_utf8_lossy(&o.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-9", pid]).status();
                }
            }
            let _ = ip(&["netns", "del", &h]);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Two hosts in network namespaces; where they cannot be made (not root, no iproute2),
/// prints `SKIPPED` and returns `None`, or fails under `HEMI_REQUIRE_NETNS=1` (CI).
fn hosts_or_skip(test: &str, name: &str) -> Option<Hosts> {
    match Hosts::create(name) {
        Ok(h) => Some(h),
        Err(e) => {
            if std::env::var("HEMI_REQUIRE_NETNS").as_deref() == Ok("1") {
                panic!("{test}: HEMI_REQUIRE_NETNS=1 but no network namespaces: {e}");
            }
            eprintln!("{test}: SKIPPED (no network namespaces; needs root and iproute2): {e}");
            None
        }
    }
}

#[test]
fn two_hosts_in_network_namespaces_train_exactly_like_one_host() {
    let test = "two_hosts_in_network_namespaces_train_exactly_like_one_host";
    let Some(hosts) = hosts_or_skip(test, "same") else {
        return;
    };
    let (apart, together) = (tmp("netns-apart"), tmp("netns-together"));
    let (o, _) = run_bounded(
        hosts.mpirun(&train_args(&apart, 16, "amp-fp16")),
        Duration::from_secs(300),
    );
    let out = ok(&o);
    // One rank on each host, as the ranks themselves saw it.
    let both = format!(
        "hosts: rank 0 on {}, rank 1 on {}",
        hosts.named(0),
        hosts.named(1)
    );
    assert!(out.contains(&both), "expected {both:?} in:\n{out}");
    assert!(out.contains("communication (rank 0): "), "{out}");
    let out = ok(&two_ranks(&train_args(&together, 16, "amp-fp16"), &[]));
    assert!(out.contains("hosts: all 2 ranks on "), "{out}");
    for epoch in [1, 2] {
        assert!(
            model_bytes(&apart, epoch) == model_bytes(&together, epoch),
            "after epoch {epoch}, two hosts and one host trained different weights"
        );
    }
}

#[test]
fn a_host_that_vanishes_mid_step_ends_the_job_within_the_timeout_naming_it() {
    let test = "a_host_that_vanishes_mid_step_ends_the_job_within_the_timeout_naming_it";
    let Some(hosts) = hosts_or_skip(test, "vanish") else {
        return;
    };
    let timeout = 4.0;
    let ckpt = tmp("netns-vanish");
    let args = with_args(
        train_args(&ckpt, 16, "fp32"),
        &[
            "--synthetic-size",
            "2048",
            "--epochs",
            "50",
            "--dist-timeout",
            &timeout.to_string(),
        ],
    );
    let mut child = hosts
        .mpirun(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start mpirun in a network namespace");
    // Mid-training: two complete checkpoints, the third epoch under way.
    let second = ckpt.join("epoch-0002/model.safetensors");
    let start = Instant::now();
    while !second.exists() {
        if child.try_wait().unwrap().is_some() || start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let o = child.wait_with_output().unwrap();
            panic!(
                "no second checkpoint:\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    // Host 1 vanishes: its link goes down, nothing it sent or will send arrives (no reset,
    // no FIN: what a power cut or a pulled cable looks like to the others).
    ip(&["-n", &hosts.host(1), "link", "set", "eth0", "down"]).unwrap();
    let cut = Instant::now();
    let limit = Duration::from_secs_f64(timeout) + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() && cut.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(50));
    }
    let ended = cut.elapsed();
    let _ = child.kill();
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        ended < limit,
        "the job still ran {ended:?} after host 1 vanished (--dist-timeout {timeout}):\n{err}"
    );
    assert!(!o.status.success(), "{err}");
    let named = format!("rank 0: no message from rank 1 on host {}", hosts.named(1));
    assert!(
        err.contains(&named),
        "the error should name the rank and its host ({named:?}):\n{err}"
    );
    eprintln!("the job ended {ended:?} after host 1 vanished (--dist-timeout {timeout} s)");
    // Nothing is lost from the last complete checkpoint: it loads, and its weights are those
    // of an uninterrupted run to the same epoch (the schedule is constant).
    let ck = load_checkpoint(&ckpt).unwrap();
    let last = ck.progress.epochs_done;
    assert!(last >= 2, "the newest checkpoint is of epoch {last}");
    let whole = tmp("netns-vanish-whole");
    let again = with_args(
        with_args(
            train_args(&whole, 16, "fp32"),
            &["--synthetic-size", "2048"],
        ),
        &["--epochs", &last.to_string()],
    );
    ok(&two_ranks(&again, &[]));
    assert!(
        model_bytes(&ckpt, last) == model_bytes(&whole, last),
        "the checkpoint of epoch {last} differs from an uninterrupted run's"
    );
}

/// The address hemi names a rank's host by, read from Open MPI's contact URI (no mpirun
/// needed).
#[test]
fn the_daemon_address_is_read_from_open_mpis_contact_uri() {
    use hemi::dist::mpi::daemon_address;
    assert_eq!(
        daemon_address("1039138816.1;tcp://10.78.0.2:44371").as_deref(),
        Some("10.78.0.2")
    );
    assert_eq!(
        daemon_address("1.0;tcp://10.0.0.1,192.168.1.1:1024").as_deref(),
        Some("10.0.0.1,192.168.1.1")
    );
    assert_eq!(daemon_address("1.0;usock"), None);
    assert_eq!(daemon_address(""), None);
}
