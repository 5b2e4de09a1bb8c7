//! The unit tests of `hemi::dist::zero` (`src/dist/zero.rs`), run against the built library:
//! the partition into pieces, the state names' index split, and sharding then gathering an
//! optimizer state.

use hemi::dist::zero::*;
use hemi::optim::{OptimizerState, StateBuffer};

#[test]
fn the_pieces_of_all_ranks_cover_every_parameter_once() {
    let numel = [5, 0, 17, 3, 64, 1];
    for bytes in [4, 40, 1 << 20] {
        let b = buckets(&numel, bytes);
        for n in 1..=5 {
            let mut seen: Vec<Vec<bool>> = numel.iter().map(|&m| vec![false; m]).collect();
            for r in 0..n {
                for pc in pieces(&numel, &b, n, r) {
                    for e in pc.range.clone() {
                        assert!(!seen[pc.param][e], "element {e} of {} twice", pc.param);
                        seen[pc.param][e] = true;
                    }
                }
            }
            assert!(seen.iter().flatten().all(|&s| s), "n={n} bytes={bytes}");
        }
    }
}

#[test]
fn index_names_split_at_the_first_number() {
    assert_eq!(split_index("3.step"), Some(("", 3, ".step")));
    assert_eq!(
        split_index("inner.12.exp_avg"),
        Some(("inner.", 12, ".exp_avg"))
    );
    assert_eq!(split_index("master.7"), Some(("master.", 7, "")));
    assert_eq!(split_index("scaler.growth_tracker"), None);
    assert_eq!(split_index("num_params"), None);
}

#[test]
fn a_state_survives_sharding_and_gathering_in_its_order() {
    let numel = [6usize, 4, 9];
    let shapes = vec![vec![2, 3], vec![4], vec![3, 3]];
    let b = buckets(&numel, 24);
    let full = OptimizerState {
        optimizer: "fp16_master".into(),
        scalars: vec![
            ("num_params".into(), 3.0),
            ("inner.num_params".into(), 3.0),
            ("inner.lr".into(), 0.5),
            ("inner.0.step".into(), 2.0),
            ("inner.1.step".into(), 2.0),
            ("inner.2.step".into(), 2.0),
            ("scaler.scale".into(), 8.0),
        ],
        buffers: (0..3)
            .flat_map(|i| {
                ["exp_avg", "exp_avg_sq"].map(|k| StateBuffer {
                    name: format!("inner.{i}.{k}"),
                    shape: shapes[i].clone(),
                    data: (0..numel[i]).map(|e| (i * 100 + e) as f32).collect(),
                })
            })
            .chain((0..3).map(|i| StateBuffer {
                name: format!("master.{i}"),
                shape: shapes[i].clone(),
                data: vec![i as f32; numel[i]],
            }))
            .collect(),
    };
    for n in 1..=4 {
        let per_rank: Vec<Vec<Piece>> = (0..n).map(|r| pieces(&numel, &b, n, r)).collect();
        let states: Vec<OptimizerState> = per_rank
            .iter()
            .map(|ps| {
                // What `ZeroShard::shard_state` does, without a process group.
                let mut s = OptimizerState {
                    optimizer: full.optimizer.clone(),
                    scalars: Vec::new(),
                    buffers: Vec::new(),
                };
                for (name, v) in &full.scalars {
                    match split_index(name) {
                        Some((pre, i, suf)) => {
                            for (k, pc) in ps.iter().enumerate() {
                                if pc.param == i {
                                    s.scalars.push((format!("{pre}{k}{suf}"), *v));
                                }
                            }
                        }
                        None => s.scalars.push((name.clone(), *v)),
                    }
                }
                // The optimizer writes its buffers piece by piece.
                for (k, pc) in ps.iter().enumerate() {
                    for f in &full.buffers {
                        let (pre, i, suf) = split_index(&f.name).unwrap();
                        if i == pc.param && pre == "inner." {
                            s.buffers.push(StateBuffer {
                                name: format!("{pre}{k}{suf}"),
                                shape: vec![pc.range.len()],
                                data: f.data[pc.range.clone()].to_vec(),
                            });
                        }
                    }
                }
                for (k, pc) in ps.iter().enumerate() {
                    let f = &full.buffers[6 + pc.param];
                    s.buffers.push(StateBuffer {
                        name: format!("master.{k}"),
                        shape: vec![pc.range.len()],
                        data: f.data[pc.range.clone()].to_vec(),
                    });
                }
                s
            })
            .collect();
        let back = unshard_state(&states, &per_rank, &shapes).unwrap();
        assert_eq!(back, full, "{n} ranks");
    }
}
