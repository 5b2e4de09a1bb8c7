//! TensorBoard event files against TensorBoard's own writer: a file written by its Python
//! `RecordWriter` (`bench/tensorboard_check.py fixture`) decodes to the values it holds, and
//! the same events encoded by hemi are the same bytes; a file hemi writes reads back whole.

use std::path::Path;

use hemi::io::tensorboard::{
    decode_records, encode_record, read_events, Event, HistogramProto, Summary, SummaryValue,
    SummaryWriter,
};
use prost::Message;

fn fixture() -> &'static Path {
    Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tensorboard/python.tfevents"
    ))
}

/// The events `bench/tensorboard_check.py fixture` writes.
fn python_events() -> Vec<Event> {
    let at = |step: i64| 1_700_000_000.5 + step as f64;
    let scalar = |step: i64, v: f32| Event {
        wall_time: at(step),
        step,
        file_version: None,
        summary: Some(Summary {
            value: vec![SummaryValue {
                tag: "train/loss".into(),
                simple_value: Some(v),
                histo: None,
            }],
        }),
    };
    vec![
        Event {
            wall_time: at(0),
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
        },
        scalar(1, 2.5),
        scalar(2, -0.125),
        scalar(10, 1e-8),
        Event {
            wall_time: at(7),
            step: 7,
            file_version: None,
            summary: Some(Summary {
                value: vec![SummaryValue {
                    tag: "params/w".into(),
                    simple_value: None,
                    histo: Some(HistogramProto {
                        min: -1.0,
                        max: 3.0,
                        num: 6.0,
                        sum: 4.5,
                        sum_squares: 12.25,
                        bucket_limit: vec![0.0, 1.0, 3.0],
                        bucket: vec![2.0, 1.0, 3.0],
                    }),
                }],
            }),
        },
    ]
}

#[test]
fn reads_the_file_tensorboards_writer_made() {
    let got = read_events(fixture()).unwrap();
    assert_eq!(got, python_events());
}

#[test]
fn encodes_byte_for_byte_as_tensorboard() {
    let want = std::fs::read(fixture()).unwrap();
    let ours: Vec<u8> = python_events()
        .iter()
        .flat_map(|e| encode_record(&e.encode_to_vec()))
        .collect();
    assert_eq!(ours.len(), want.len());
    assert!(ours == want, "hemi's records differ from TensorBoard's");
}

#[test]
fn a_written_file_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let logdir = dir.path().join("run");
    let mut w = SummaryWriter::create(&logdir).unwrap();
    let mut w2 = SummaryWriter::create(&logdir).unwrap();
    assert_ne!(w.path(), w2.path(), "two writers share a file");
    for step in 1..=5u64 {
        w.add_scalar("train/loss", 1.0 / step as f64, step).unwrap();
    }
    let values: Vec<f32> = (0..100).map(|i| (i as f32 - 50.0) / 7.0).collect();
    w.add_histogram("params/w", &values, 5).unwrap();
    w2.add_scalar("other", 3.0, 1).unwrap();
    drop(w2);
    w.flush().unwrap();
    let name = w.path().file_name().unwrap().to_string_lossy().to_string();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    let events = read_events(w.path()).unwrap();
    assert_eq!(events.len(), 7);
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    for (e, step) in events[1..6].iter().zip(1..) {
        assert_eq!(e.step, step);
        let v = &e.summary.as_ref().unwrap().value[0];
        assert_eq!(v.tag, "train/loss");
        assert_eq!(v.simple_value, Some((1.0 / step as f64) as f32));
    }
    let h = events[6].summary.as_ref().unwrap().value[0]
        .histo
        .clone()
        .unwrap();
    assert_eq!(h.num, 100.0);
    assert_eq!(h.bucket.iter().sum::<f64>(), 100.0);
    assert_eq!(h.min, f64::from(values[0]));
    assert_eq!(h.max, f64::from(values[99]));
    let sq: f64 = values.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    assert!((h.sum_squares - sq).abs() <= 1e-12 * sq);
    // A truncated file is an error naming the file, not a panic or a silent short read.
    let bytes = std::fs::read(w.path()).unwrap();
    let e = decode_records(&bytes[..bytes.len() - 3], "cut.tfevents").unwrap_err();
    assert!(e.to_string().contains("cut.tfevents"), "{e}");
}
