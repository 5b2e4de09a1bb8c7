//! TensorBoard event files: scalars and histograms that `tensorboard --logdir DIR` shows.
//!
//! An event file is a sequence of records, each `u64` length (little-endian), the masked
//! CRC-32C of those 8 bytes, the payload, and the masked CRC-32C of the payload; the payload
//! is a protobuf `tensorflow.Event`. The messages below carry the field numbers of
//! TensorFlow's `event.proto` / `summary.proto` (only the fields hemi writes and reads;
//! `prost` skips the rest when decoding). A `oneof` is written as optional fields: on the
//! wire a oneof member is an ordinary field that is present.
//!
//! Why no crate for this: the one published writer (`tensorboard-rs`, last release 2022,
//! marked inactive by its author) pulls `protobuf` 2.x and `image` 0.23 for about 100k
//! lines of dependencies; the format is a few dozen lines over `prost` (which the ONNX
//! exporter uses too) and `crc32c`.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;

use crate::error::{Error, Result};

/// `tensorflow.Event`: one record of an event file.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    /// Seconds since the Unix epoch when the event was written.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// The global step the values belong to (TensorBoard's x axis).
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// The first event of a file: `"brain.Event:2"`.
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    /// Tagged values.
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
}

/// `tensorflow.Summary`: a list of tagged values.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    /// The values, each with its tag.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value`: one tagged scalar or histogram.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    /// The series name, e.g. `train/loss`; `/` groups series in TensorBoard's UI.
    #[prost(string, tag = "1")]
    pub tag: String,
    /// A scalar (TensorBoard's scalars dashboard).
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
    /// A histogram (TensorBoard's histograms and distributions dashboards).
    #[prost(message, optional, tag = "5")]
    pub histo: Option<HistogramProto>,
}

/// `tensorflow.HistogramProto`: bucket `i` counts the values in
/// `(bucket_limit[i-1], bucket_limit[i]]`, the first bucket starting at `min`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HistogramProto {
    /// Smallest value.
    #[prost(double, tag = "1")]
    pub min: f64,
    /// Largest value.
    #[prost(double, tag = "2")]
    pub max: f64,
    /// Number of values.
    #[prost(double, tag = "3")]
    pub num: f64,
    /// Sum of the values.
    #[prost(double, tag = "4")]
    pub sum: f64,
    /// Sum of their squares.
    #[prost(double, tag = "5")]
    pub sum_squares: f64,
    /// Right edge of each bucket, increasing.
    #[prost(double, repeated, tag = "6")]
    pub bucket_limit: Vec<f64>,
    /// Count of each bucket.
    #[prost(double, repeated, tag = "7")]
    pub bucket: Vec<f64>,
}

/// Buckets of `histogram`: TensorBoard re-bins for display, 64 is fine-grained enough.
const HISTOGRAM_BUCKETS: usize = 64;

/// A histogram of the finite `values` (NaN and ±inf are left out: TensorBoard cannot place
/// them) in equal-width buckets between their minimum and maximum, sums in f64.
pub fn histogram(values: &[f32]) -> HistogramProto {
    let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
    let (mut num, mut sum, mut sum_squares) = (0u64, 0.0f64, 0.0f64);
    for &v in values.iter().filter(|v| v.is_finite()) {
        let v = f64::from(v);
        min = min.min(v);
        max = max.max(v);
        num += 1;
        sum += v;
        sum_squares += v * v;
    }
    if num == 0 {
        return HistogramProto::default();
    }
    let width = (max - min) / HISTOGRAM_BUCKETS as f64;
    let (bucket_limit, mut bucket) = if width > 0.0 {
        let limits = (1..=HISTOGRAM_BUCKETS)
            .map(|i| {
                if i == HISTOGRAM_BUCKETS {
                    max
                } else {
                    min + width * i as f64
                }
            })
            .collect();
        (limits, vec![0.0; HISTOGRAM_BUCKETS])
    } else {
        (vec![max], vec![0.0])
    };
    for &v in values.iter().filter(|v| v.is_finite()) {
        let i = if width > 0.0 {
            // (limit[i-1], limit[i]]: a value on an edge belongs to the bucket it closes.
            let k = ((f64::from(v) - min) / width).ceil() as usize;
            k.saturating_sub(1).min(bucket.len() - 1)
        } else {
            0
        };
        bucket[i] += 1.0;
    }
    HistogramProto {
        min,
        max,
        num: num as f64,
        sum,
        sum_squares,
        bucket_limit,
        bucket,
    }
}

/// TensorFlow's CRC mask: stored CRCs are rotated and offset so that a CRC of data that
/// itself holds CRCs stays well distributed.
#[doc(hidden)]
pub fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One record: length, its masked CRC, payload, the payload's masked CRC.
pub fn encode_record(payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(payload.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&masked_crc(payload).to_le_bytes());
    out
}

/// The payloads of the records in `bytes`, each CRC checked; `what` names the source in
/// errors (a truncated or corrupt record is an error naming its byte offset).
pub fn decode_records(bytes: &[u8], what: &str) -> Result<Vec<Vec<u8>>> {
    let bad = |at: usize, why: &str| Error::Msg(format!("{what}: record at byte {at}: {why}"));
    let mut out = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let head = bytes
            .get(at..at + 12)
            .ok_or_else(|| bad(at, "truncated header"))?;
        let len_bytes: [u8; 8] = head[..8].try_into().expect("8 bytes");
        let crc = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
        if crc != masked_crc(&len_bytes) {
            return Err(bad(at, "length CRC mismatch"));
        }
        let len = u64::from_le_bytes(len_bytes);
        let start = at + 12;
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| start.checked_add(l))
            .filter(|&e| e.checked_add(4).is_some_and(|e4| e4 <= bytes.len()))
            .ok_or_else(|| bad(at, &format!("truncated payload of {len} bytes")))?;
        let payload = &bytes[start..end];
        let crc = u32::from_le_bytes(bytes[end..end + 4].try_into().expect("4 bytes"));
        if crc != masked_crc(payload) {
            return Err(bad(at, "payload CRC mismatch"));
        }
        out.push(payload.to_vec());
        at = end + 4;
    }
    Ok(out)
}

/// Reads every event of an event file, checking each record's CRCs.
pub fn read_events(path: &Path) -> Result<Vec<Event>> {
    let bytes = fs::read(path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })?;
    let what = path.display().to_string();
    decode_records(&bytes, &what)?
        .iter()
        .enumerate()
        .map(|(i, p)| {
            Event::decode(p.as_slice())
                .map_err(|e| Error::Msg(format!("{what}: event {i} is not an Event: {e}")))
        })
        .collect()
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Writes one event file in a log directory, as PyTorch's
/// `torch.utils.tensorboard.SummaryWriter` does: `add_scalar`, `add_histogram`, `flush`.
///
/// Each writer makes a new file (`events.out.tfevents.<seconds>.<host>.<pid>.<n>`), so a
/// resumed run adds a file beside the first and TensorBoard shows both as one run.
/// Records are buffered; `flush` (and dropping the writer) writes them out.
pub struct SummaryWriter {
    file: BufWriter<File>,
    path: PathBuf,
}

impl SummaryWriter {
    /// Creates `logdir` if needed and a new event file in it.
    pub fn create(logdir: &Path) -> Result<Self> {
        let io = |p: &Path, source| Error::Io {
            path: p.display().to_string(),
            source,
        };
        fs::create_dir_all(logdir).map_err(|e| io(logdir, e))?;
        let host = fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .ok()
            .filter(|h| !h.is_empty() && !h.contains(['/', '\\']))
            .unwrap_or_else(|| "localhost".into());
        let secs = now() as u64;
        let pid = std::process::id();
        // A second writer in the same second and process gets the next free number.
        let (path, file) = (0u32..)
            .find_map(|n| {
                let p = logdir.join(format!("events.out.tfevents.{secs:010}.{host}.{pid}.{n}"));
                match fs::OpenOptions::new().write(true).create_new(true).open(&p) {
                    Ok(f) => Some(Ok((p, f))),
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => None,
                    Err(e) => Some(Err(io(&p, e))),
                }
            })
            .expect("an unbounded range finds a name or an error")?;
        let mut w = SummaryWriter {
            file: BufWriter::new(file),
            path,
        };
        w.write_event(&Event {
            wall_time: now(),
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
        })?;
        w.flush()?;
        Ok(w)
    }

    /// The event file this writer appends to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event (buffered).
    pub fn write_event(&mut self, event: &Event) -> Result<()> {
        let record = encode_record(&event.encode_to_vec());
        self.file.write_all(&record).map_err(|source| Error::Io {
            path: self.path.display().to_string(),
            source,
        })
    }

    fn write_value(&mut self, step: u64, value: SummaryValue) -> Result<()> {
        self.write_event(&Event {
            wall_time: now(),
            step: step as i64,
            file_version: None,
            summary: Some(Summary { value: vec![value] }),
        })
    }

    /// A scalar point of series `tag` at `step` (stored as F32, as TensorBoard does).
    pub fn add_scalar(&mut self, tag: &str, value: f64, step: u64) -> Result<()> {
        self.write_value(
            step,
            SummaryValue {
                tag: tag.into(),
                simple_value: Some(value as f32),
                histo: None,
            },
        )
    }

    /// A histogram of `values` (see [`histogram`]) for series `tag` at `step`.
    pub fn add_histogram(&mut self, tag: &str, values: &[f32], step: u64) -> Result<()> {
        self.add_histogram_proto(tag, histogram(values), step)
    }

    /// A histogram already bucketed.
    pub fn add_histogram_proto(&mut self, tag: &str, h: HistogramProto, step: u64) -> Result<()> {
        self.write_value(
            step,
            SummaryValue {
                tag: tag.into(),
                simple_value: None,
                histo: Some(h),
            },
        )
    }

    /// Writes the buffered records to the file (TensorBoard sees them from then on).
    pub fn flush(&mut self) -> Result<()> {
        self.file.flush().map_err(|source| Error::Io {
            path: self.path.display().to_string(),
            source,
        })
    }
}

impl Drop for SummaryWriter {
    fn drop(&mut self) {
        let _ = self.file.flush();
    }
}
