//! The unit tests of `hemi::cpu::runs` (`src/cpu/runs.rs`), run against the built library.

use hemi::cpu::runs::*;

#[test]
fn runs_cover_the_items_in_whole_units() {
    for n in [0, 1, 7, 16, 17, 128, 1000] {
        for unit in [1, 3, 16] {
            for min_len in [1, 5, 100] {
                let r = Runs::new(n, unit, min_len);
                assert!(r.count <= MAX_RUNS, "{n} {unit} {min_len}: {r:?}");
                assert_eq!(r.len % unit, 0);
                let covered: Vec<usize> = (0..r.count).flat_map(|i| r.range(i, n)).collect();
                assert_eq!(covered, (0..n).collect::<Vec<_>>(), "{n} {unit} {r:?}");
            }
        }
    }
}

/// Waves of partials give the bits of all partials at once, for any wave size.
#[test]
fn sums_in_waves_equal_all_partials_at_once() {
    let n = 37;
    let r = Runs::new(n, 1, 1);
    let part = |run: usize, len: usize| -> Vec<f32> {
        (0..len)
            .map(|i| {
                let v = ((i * 7 + run * 13) % 101) as f32 * 0.37;
                if run.is_multiple_of(3) {
                    v * 1e7
                } else {
                    -v
                }
            })
            .collect()
    };
    // Small partials (one wave) and partials above WAVE_BYTES (one per thread a wave).
    for len in [5, WAVE_BYTES / 4 + 3] {
        let want = add_in_order(r.map_init(|| (), |_, run| part(run, len)), len);
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let got = pool.install(|| r.sum_init(len, || (), |_, run| part(run, len)));
            assert!(got == want, "len {len}, {threads} threads");
        }
    }
    assert_eq!(
        Runs::new(0, 1, 1).sum_init(3, || (), |_, _| vec![1f32; 3]),
        vec![0.0; 3]
    );
}

#[test]
fn partials_add_in_run_order() {
    // 1e8 + 1 - 1e8 in f32 depends on the grouping: left to right it is 0.
    let p = vec![vec![1e8f32; 3], vec![1.0; 3], vec![-1e8; 3]];
    assert_eq!(add_in_order(p, 3), vec![0.0; 3]);
    assert_eq!(add_in_order::<f32>(Vec::new(), 2), vec![0.0; 2]);
    // The parallel path gives the same bits as the serial one.
    let n = 3 * ADD_CHUNK + 5;
    let parts: Vec<Vec<f32>> = (0..9)
        .map(|r| {
            (0..n)
                .map(|i| ((i * 7 + r * 13) % 101) as f32 * 0.37)
                .collect()
        })
        .collect();
    let want: Vec<f32> = (0..n)
        .map(|i| parts.iter().skip(1).fold(parts[0][i], |a, p| a + p[i]))
        .collect();
    assert_eq!(add_in_order(parts, n), want);
}
