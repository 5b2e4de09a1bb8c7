//! Text data sets: `TextDataset`, the trait the loader reads texts through;
//! `TextClassificationDataset`, labelled sentences (or sentence pairs) from a CSV or TSV
//! file such as GLUE's SST-2; `TextCorpus`, one unlabelled example per line for masked-LM.
//!
//! Files are read whole at `open` and kept as strings; the loader tokenises them (see
//! `loader.rs`). Errors name the file, the 1-based line and what is wrong.
//!
//! TSV files are read without quoting, as GLUE's are written: a `"` in a sentence is text
//! (with CSV quoting, one unbalanced quote would swallow the lines after it), and a tab
//! cannot occur inside a field anyway. CSV files follow RFC 4180 (quoted fields may hold commas,
//! doubled quotes and newlines).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::dataset::{data_error, io_error, read_file};
use crate::error::{Error, Result};

/// One sample of a text data set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TextSample<'a> {
    /// The text (the first sentence of a pair).
    pub text: &'a str,
    /// The second text of a sentence-pair task (`None` for single sentences).
    pub text_pair: Option<&'a str>,
    /// Class index in `0..num_classes()`; `None` for unlabelled text.
    pub label: Option<usize>,
}

/// A data set of texts, with optional pairs and class labels. `Send + Sync` so that the
/// loader's workers share it.
pub trait TextDataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;
    /// True when the set holds no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Sample `index`; `Error::Index` past the end.
    fn get(&self, index: usize) -> Result<TextSample<'_>>;
    /// Class names, index = label; empty for unlabelled text.
    fn class_names(&self) -> &[String];
    /// Number of classes (the length of `class_names`; 0 for unlabelled text).
    fn num_classes(&self) -> usize {
        self.class_names().len()
    }
}

/// Which column of a CSV/TSV file: by header name or 0-based position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Column {
    /// A column named by the header line.
    Name(String),
    /// A column by 0-based position.
    Index(usize),
}

impl From<&str> for Column {
    fn from(s: &str) -> Column {
        Column::Name(s.to_string())
    }
}

impl From<usize> for Column {
    fn from(i: usize) -> Column {
        Column::Index(i)
    }
}

impl std::fmt::Display for Column {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Column::Name(n) => write!(f, "column {n:?}"),
            Column::Index(i) => write!(f, "column {i} (0-based)"),
        }
    }
}

/// Where a `TextClassificationDataset` finds its fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextColumns {
    /// The column holding the text.
    pub text: Column,
    /// The second sentence of a pair task (MNLI, QQP...).
    pub text_pair: Option<Column>,
    /// The column holding the label (class names or 0-based indices).
    pub label: Column,
    /// The first line names the columns.
    pub header: bool,
    /// Field separator; `None` chooses by extension: `.tsv` tab, `.csv` comma.
    pub delimiter: Option<u8>,
    /// The declared number of classes for integer labels: every label must be below it,
    /// and classes no line uses are allowed. `None`: the classes are the labels seen, which
    /// must then be exactly 0..N-1 for the N distinct labels (a gap, such as labels 0, 1 and
    /// 7, is an error listing the odd labels and their lines).
    pub num_classes: Option<usize>,
}

impl TextColumns {
    /// Single sentences in column `text`, labels in column `label`, with a header line
    /// (GLUE SST-2: `TextColumns::named("sentence", "label")`).
    pub fn named(text: &str, label: &str) -> TextColumns {
        TextColumns {
            text: Column::Name(text.to_string()),
            text_pair: None,
            label: Column::Name(label.to_string()),
            header: true,
            delimiter: None,
            num_classes: None,
        }
    }
}

/// Labelled texts from a CSV or TSV file (see the module docs).
///
/// Labels: when every label is a non-negative integer, label `k` is class `k` and the
/// classes are "0".."K-1", K being the number of distinct labels (the labels must then be
/// exactly 0..K-1) or the declared `TextColumns::num_classes`; when no label looks like a number, the
/// classes are the distinct label strings, sorted, and a label is its position among them.
/// A file that mixes the two (`1`, `0`, `-1`, or `pos`, `3`) is an error naming the first
/// label that does not fit, as is an empty label.
#[derive(Clone, Debug)]
pub struct TextClassificationDataset {
    path: PathBuf,
    texts: Vec<String>,
    pairs: Option<Vec<String>>,
    labels: Vec<u32>,
    class_names: Vec<String>,
}

/// More classes than this is a column that is not a class label.
const MAX_CLASSES: usize = 1 << 20;

impl TextClassificationDataset {
    /// Reads `path` (see `TextColumns` and the type's docs).
    pub fn open(path: impl AsRef<Path>, columns: TextColumns) -> Result<TextClassificationDataset> {
        let path = path.as_ref();
        let delimiter = match columns.delimiter {
            Some(d) => d,
            None => match path
                .extension()
                .and_then(|e| e.to_str())
                .map(|e| e.to_ascii_lowercase())
                .as_deref()
            {
                Some("tsv") => b'\t',
                Some("csv") => b',',
                _ => {
                    return Err(data_error(
                        path,
                        "cannot tell the field separator from the extension (expected .tsv or \
                         .csv); set TextColumns.delimiter",
                    ))
                }
            },
        };
        let bytes = read_file(path, "a CSV or TSV file of labelled texts")?;
        let mut reader = csv::ReaderBuilder::new()
            .delimiter(delimiter)
            .has_headers(false)
            .flexible(true)
            .quoting(delimiter != b'\t')
            .from_reader(bytes.as_slice());

        let mut records = reader.records();
        let mut next = || -> Result<Option<(u64, csv::StringRecord)>> {
            match records.next() {
                None => Ok(None),
                Some(Ok(r)) => {
                    let line = r.position().map_or(0, |p| p.line());
                    Ok(Some((line, r)))
                }
                Some(Err(e)) => Err(csv_error(path, e)),
            }
        };

        // The header (if any) resolves column names; its field count is every row's.
        let header = if columns.header {
            match next()? {
                Some((_, r)) => Some(r),
                None => {
                    return Err(data_error(
                        path,
                        "the file is empty: expected a header line",
                    ))
                }
            }
        } else {
            None
        };
        let resolve = |c: &Column| -> Result<usize> {
            match (c, &header) {
                (Column::Index(i), _) => Ok(*i),
                (Column::Name(n), Some(h)) => {
                    h.iter().position(|f| f.trim() == n).ok_or_else(|| {
                        data_error(
                            path,
                            format!(
                                "line 1: no column named {n:?} in the header (columns: {})",
                                h.iter().collect::<Vec<_>>().join(", ")
                            ),
                        )
                    })
                }
                (Column::Name(n), None) => Err(data_error(
                    path,
                    format!(
                        "column {n:?} is named but the file has no header line (header: false); \
                         use Column::Index"
                    ),
                )),
            }
        };
        let text_col = resolve(&columns.text)?;
        let pair_col = columns.text_pair.as_ref().map(resolve).transpose()?;
        let label_col = resolve(&columns.label)?;

        let mut width = header.as_ref().map(|h| (h.len(), 1u64));
        let mut texts = Vec::new();
        let mut pairs = pair_col.map(|_| Vec::new());
        let mut raw_labels: Vec<(String, u64)> = Vec::new();
        while let Some((line, r)) = next()? {
            match width {
                None => width = Some((r.len(), line)),
                Some((w, first)) if r.len() != w => {
                    return Err(data_error(
                        path,
                        format!(
                            "line {line}: {} fields, expected {w} (as line {first} has)",
                            r.len()
                        ),
                    ))
                }
                Some(_) => {}
            }
            let field = |c: usize, what: &Column| {
                r.get(c).ok_or_else(|| {
                    data_error(
                        path,
                        format!(
                            "line {line}: no {what}: the line has {} fields (0-based columns 0..{})",
                            r.len(),
                            r.len()
                        ),
                    )
                })
            };
            texts.push(field(text_col, &columns.text)?.to_string());
            if let (Some(c), Some(p), Some(col)) = (pair_col, pairs.as_mut(), &columns.text_pair) {
                p.push(field(c, col)?.to_string());
            }
            raw_labels.push((field(label_col, &columns.label)?.trim().to_string(), line));
        }
        let (labels, class_names) = assign_labels(path, &raw_labels, columns.num_classes)?;
        texts.shrink_to_fit();
        Ok(TextClassificationDataset {
            path: path.to_path_buf(),
            texts,
            pairs,
            labels,
            class_names,
        })
    }

    /// A data set from texts in memory: `labels[i]` is the class of `texts[i]` and must be
    /// below `class_names.len()`; `pairs`, if given, has one second text per text.
    pub fn new(
        texts: Vec<String>,
        pairs: Option<Vec<String>>,
        labels: Vec<usize>,
        class_names: Vec<String>,
    ) -> Result<TextClassificationDataset> {
        let op = "TextClassificationDataset::new";
        if labels.len() != texts.len() || pairs.as_ref().is_some_and(|p| p.len() != texts.len()) {
            return Err(Error::arg(
                op,
                format!(
                    "{} texts, {} labels and {} pairs: expected one of each per sample",
                    texts.len(),
                    labels.len(),
                    pairs
                        .as_ref()
                        .map_or("no".to_string(), |p| p.len().to_string())
                ),
            ));
        }
        if let Some(&l) = labels.iter().find(|&&l| l >= class_names.len()) {
            return Err(Error::Index {
                op,
                index: l as i64,
                size: class_names.len(),
            });
        }
        Ok(TextClassificationDataset {
            path: PathBuf::from("<memory>"),
            texts,
            pairs,
            labels: labels.into_iter().map(|l| l as u32).collect(),
            class_names,
        })
    }

    /// The file read (`<memory>` for `new`).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The class index of every sample.
    pub fn labels(&self) -> &[u32] {
        &self.labels
    }

    /// Samples per class.
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.class_names.len()];
        for &l in &self.labels {
            counts[l as usize] += 1;
        }
        counts
    }
}

impl TextDataset for TextClassificationDataset {
    fn len(&self) -> usize {
        self.texts.len()
    }
    fn get(&self, index: usize) -> Result<TextSample<'_>> {
        let text = self.texts.get(index).ok_or(Error::Index {
            op: "TextClassificationDataset::get",
            index: index as i64,
            size: self.texts.len(),
        })?;
        Ok(TextSample {
            text,
            text_pair: self.pairs.as_ref().map(|p| p[index].as_str()),
            label: Some(self.labels[index] as usize),
        })
    }
    fn class_names(&self) -> &[String] {
        &self.class_names
    }
}

/// Class indices and names from the label strings (see `TextClassificationDataset`).
fn assign_labels(
    path: &Path,
    raw: &[(String, u64)],
    declared: Option<usize>,
) -> Result<(Vec<u32>, Vec<String>)> {
    if declared == Some(0) || declared.is_some_and(|k| k > MAX_CLASSES) {
        return Err(data_error(
            path,
            format!(
                "the declared class count {} is not in 1..={MAX_CLASSES}",
                declared.unwrap_or(0)
            ),
        ));
    }
    if let Some((_, line)) = raw.iter().find(|(s, _)| s.is_empty()) {
        return Err(data_error(path, format!("line {line}: empty label")));
    }
    // "nan" and "inf" parse as numbers but are names; a number has a digit.
    let looks_numeric = |s: &str| s.parse::<f64>().is_ok() && s.bytes().any(|b| b.is_ascii_digit());
    let numeric = raw.iter().find(|(s, _)| looks_numeric(s));
    if let Some((example, example_line)) = numeric {
        // Integer labels: every one must be a class index.
        let mut labels = Vec::with_capacity(raw.len());
        for (s, line) in raw {
            match s.parse::<u64>() {
                Ok(v) if (v as usize) < MAX_CLASSES => labels.push(v as u32),
                Ok(v) => {
                    return Err(data_error(
                        path,
                        format!(
                            "line {line}: label {v} is too large for a class index (at most {})",
                            MAX_CLASSES - 1
                        ),
                    ))
                }
                Err(_) => {
                    return Err(data_error(
                        path,
                        format!(
                            "line {line}: bad label {s:?}: labels must all be class indices \
                             (non-negative integers, as {example:?} on line {example_line}) or \
                             all be class names that are not numbers"
                        ),
                    ))
                }
            }
        }
        let distinct: BTreeSet<u32> = labels.iter().copied().collect();
        let k = declared.unwrap_or(distinct.len());
        // Labels at or above the class count: with gaps, an integer column would silently
        // build a head as wide as its largest label.
        let odd: Vec<u32> = distinct.range(k as u32..).copied().collect();
        if !odd.is_empty() {
            let show = |v: u32| {
                let lines: Vec<String> = raw
                    .iter()
                    .zip(&labels)
                    .filter(|(_, &l)| l == v)
                    .map(|((_, line), _)| line.to_string())
                    .collect();
                let more = lines.len().saturating_sub(5);
                let mut text = format!("{v} (line {}", lines[..lines.len().min(5)].join(", "));
                if more > 0 {
                    text.push_str(&format!(" and {more} more"));
                }
                text.push(')');
                text
            };
            let listed: Vec<String> = odd.iter().take(10).map(|&v| show(v)).collect();
            let rest = odd.len().saturating_sub(10);
            let tail = if rest > 0 {
                format!(" and {rest} more labels")
            } else {
                String::new()
            };
            let why = match declared {
                Some(k) => format!("the declared class count is {k}, so labels must be 0..{k}"),
                None => format!(
                    "{} distinct labels were seen, so they must be 0..{} (integer labels are \
                     class indices); if the data set has more classes than it uses, declare \
                     them (hemi train --num-classes N)",
                    distinct.len(),
                    distinct.len()
                ),
            };
            return Err(data_error(
                path,
                format!("labels out of range: {}{tail}; {why}", listed.join(", ")),
            ));
        }
        Ok((labels, (0..k).map(|i| i.to_string()).collect()))
    } else {
        if let Some(k) = declared {
            return Err(data_error(
                path,
                format!(
                    "a class count ({k}) was declared, but the labels are class names (as \
                     {:?} on line {}), whose classes are the names seen",
                    raw.first().map_or("", |r| r.0.as_str()),
                    raw.first().map_or(0, |r| r.1)
                ),
            ));
        }
        let names: Vec<String> = raw
            .iter()
            .map(|(s, _)| s.clone())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let labels = raw
            .iter()
            .map(|(s, _)| names.binary_search(s).map_or(0, |i| i as u32))
            .collect();
        Ok((labels, names))
    }
}

/// A `csv` error as `Error::Data` with the line it happened on.
fn csv_error(path: &Path, e: csv::Error) -> Error {
    let line = e.position().map(|p| p.line());
    let msg = match e.kind() {
        csv::ErrorKind::Utf8 { err, .. } => format!(
            "invalid UTF-8 in field {} (0-based): text files must be UTF-8",
            err.field()
        ),
        _ => e.to_string(),
    };
    if let csv::ErrorKind::Io(io) = e.kind() {
        return io_error(path, std::io::Error::new(io.kind(), io.to_string()));
    }
    match line {
        Some(l) => data_error(path, format!("line {l}: {msg}")),
        None => data_error(path, msg),
    }
}

/// Unlabelled text for masked-LM: one example per non-blank line of a UTF-8 file (a
/// trailing `\r` is dropped, other whitespace kept).
#[derive(Clone, Debug)]
pub struct TextCorpus {
    path: PathBuf,
    lines: Vec<String>,
}

impl TextCorpus {
    /// Reads a UTF-8 text file, one example per non-blank line; an unreadable file is an
    /// `Error::Io`, invalid UTF-8 an `Error::Data` naming the line.
    pub fn open(path: impl AsRef<Path>) -> Result<TextCorpus> {
        let path = path.as_ref();
        let bytes = read_file(path, "a text file with one example per line")?;
        let text = std::str::from_utf8(&bytes).map_err(|e| {
            let line = 1 + bytes[..e.valid_up_to()]
                .iter()
                .filter(|&&b| b == b'\n')
                .count();
            data_error(
                path,
                format!("line {line}: invalid UTF-8: text files must be UTF-8"),
            )
        })?;
        let lines = text
            .split('\n')
            .map(|l| l.strip_suffix('\r').unwrap_or(l))
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect();
        Ok(TextCorpus {
            path: path.to_path_buf(),
            lines,
        })
    }

    /// A corpus of the given examples (blank ones dropped).
    pub fn from_lines(lines: Vec<String>) -> TextCorpus {
        TextCorpus {
            path: PathBuf::from("<memory>"),
            lines: lines.into_iter().filter(|l| !l.trim().is_empty()).collect(),
        }
    }

    /// The file the corpus was read from (`<memory>` for `from_lines`).
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl TextDataset for TextCorpus {
    fn len(&self) -> usize {
        self.lines.len()
    }
    fn get(&self, index: usize) -> Result<TextSample<'_>> {
        let text = self.lines.get(index).ok_or(Error::Index {
            op: "TextCorpus::get",
            index: index as i64,
            size: self.lines.len(),
        })?;
        Ok(TextSample {
            text,
            text_pair: None,
            label: None,
        })
    }
    fn class_names(&self) -> &[String] {
        &[]
    }
}
