//! Data sets, transforms and the loader: readers against files of the exact official layouts
//! written by the tests, every malformed-file error naming the file, and the loader's
//! ordering guarantees (exactly once per epoch, seeded shuffle, worker-count independence).

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hemi::data::*;
use hemi::{DType, Error, Generator};

use crate::common::{write_png_raw, write_png_rgb};

// ----- helpers ---------------------------------------------------------------------------

/// A CIFAR-10 record: label byte, then R, G, B planes whose bytes encode (record, channel,
/// pixel) so a misplaced byte shows.
fn cifar_record(label: u8, seed: usize) -> Vec<u8> {
    let mut r = vec![label];
    for c in 0..3 {
        r.extend((0..1024).map(|p| ((seed * 7 + c * 101 + p * 13) % 256) as u8));
    }
    r
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::File::create(path)
        .unwrap()
        .write_all(bytes)
        .unwrap();
}

/// Writes data_batch_1..5.bin with `per_file` records each and test_batch.bin with
/// `test` records; record j of the train split has label j % 10 and seed j.
fn write_cifar(dir: &Path, per_file: usize, test: usize) {
    for f in 0..5 {
        let bytes: Vec<u8> = (0..per_file)
            .flat_map(|i| {
                let j = f * per_file + i;
                cifar_record((j % 10) as u8, j)
            })
            .collect();
        write(&dir.join(format!("data_batch_{}.bin", f + 1)), &bytes);
    }
    let bytes: Vec<u8> = (0..test)
        .flat_map(|i| cifar_record(((i + 3) % 10) as u8, 1000 + i))
        .collect();
    write(&dir.join("test_batch.bin"), &bytes);
}

/// The error's message, which must name `path`.
fn data_error_naming(err: Error, path: &Path) -> String {
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "error does not name {}: {msg}",
        path.display()
    );
    msg
}

fn idx_images(count: u32, rows: u32, cols: u32, magic: u32) -> Vec<u8> {
    let mut b = Vec::new();
    for w in [magic, count, rows, cols] {
        b.extend(w.to_be_bytes());
    }
    b.extend((0..count * rows * cols).map(|i| (i * 31 % 251) as u8));
    b
}

fn idx_labels(labels: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(IDX_LABELS_MAGIC.to_be_bytes());
    b.extend((labels.len() as u32).to_be_bytes());
    b.extend(labels);
    b
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

/// A small in-memory data set whose image `i` is filled with byte `i % 256` and labelled
/// `i % classes`.
fn counting_set(n: usize, classes: usize, shape: [usize; 3]) -> Arc<dyn Dataset> {
    let per: usize = shape.iter().product();
    let pixels = (0..n).flat_map(|i| vec![(i % 256) as u8; per]).collect();
    let labels = (0..n).map(|i| (i % classes) as u32).collect();
    let names = (0..classes).map(|c| format!("c{c}")).collect();
    Arc::new(InMemoryDataset::new(shape, pixels, labels, names).unwrap())
}

fn config(batch: usize, workers: usize) -> LoaderConfig {
    LoaderConfig {
        batch_size: batch,
        workers,
        seed: 11,
        ..LoaderConfig::default()
    }
}

/// Every batch of an epoch as (images, labels, indices), failing on any error.
fn collect_epoch(loader: &DataLoader, epoch: u64) -> Vec<(Vec<f32>, Vec<i64>, Vec<usize>)> {
    loader
        .epoch(epoch)
        .map(|b| {
            let b = b.unwrap();
            (
                b.images().unwrap().to_vec_f32(),
                b.labels.to_vec_i64(),
                b.indices,
            )
        })
        .collect()
}

// ----- CIFAR-10 binary -------------------------------------------------------------------

#[test]
fn cifar10_reads_official_layout() {
    let dir = tempfile::tempdir().unwrap();
    write_cifar(dir.path(), 3, 4);
    let train = Cifar10::load(dir.path(), Split::Train).unwrap();
    assert_eq!(train.len(), 15);
    assert_eq!(train.image_shape(), [3, 32, 32]);
    assert_eq!(train.num_classes(), 10);
    assert_eq!(train.class_names()[0], "airplane");
    assert_eq!(train.class_names()[9], "truck");
    // Files are concatenated in order 1..5; bytes land in CHW order unchanged.
    for j in [0, 4, 14] {
        let s = train.get(j).unwrap();
        let rec = cifar_record((j % 10) as u8, j);
        assert_eq!(s.label, j % 10);
        assert_eq!(s.image.data(), &rec[1..]);
        // Channel 1 (green), row 2, column 5 is byte 1 + 1024 + 2 * 32 + 5 of the record.
        assert_eq!(s.image.get(1, 2, 5), rec[1 + 1024 + 2 * 32 + 5]);
    }
    let test = Cifar10::load(dir.path(), Split::Test).unwrap();
    assert_eq!(test.len(), 4);
    assert_eq!(test.get(2).unwrap().label, 5);
    assert!(test.get(4).is_err(), "index past the end");
    // locate finds the directory itself and the archive's subdirectory, nothing elsewhere.
    assert_eq!(Cifar10::locate(dir.path()).as_deref(), Some(dir.path()));
    let outer = tempfile::tempdir().unwrap();
    assert!(Cifar10::locate(outer.path()).is_none());
    std::fs::rename(dir.path(), outer.path().join("cifar-10-batches-bin")).unwrap();
    assert_eq!(
        Cifar10::locate(outer.path()),
        Some(outer.path().join("cifar-10-batches-bin"))
    );
}

#[test]
fn cifar10_meta_file_names_classes() {
    let dir = tempfile::tempdir().unwrap();
    write_cifar(dir.path(), 1, 1);
    let names: Vec<String> = (0..10).map(|i| format!("k{i}")).collect();
    write(
        &dir.path().join("batches.meta.txt"),
        names.join("\n").as_bytes(),
    );
    let test = Cifar10::load(dir.path(), Split::Test).unwrap();
    assert_eq!(test.class_names(), &names[..]);
    write(&dir.path().join("batches.meta.txt"), b"a\nb\n");
    let msg = data_error_naming(
        Cifar10::load(dir.path(), Split::Test).unwrap_err(),
        &dir.path().join("batches.meta.txt"),
    );
    assert!(msg.contains("2 class names"), "{msg}");
}

#[test]
fn cifar10_bad_files_are_errors_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    write_cifar(dir.path(), 2, 2);
    let bad = dir.path().join("data_batch_3.bin");

    // Truncated: one byte short of 10 records.
    let rec = Cifar10::RECORD_BYTES;
    write(&bad, &vec![0u8; 10 * rec - 1]);
    let msg = data_error_naming(Cifar10::load(dir.path(), Split::Train).unwrap_err(), &bad);
    assert!(
        msg.contains("size 30729 is not a multiple of the 3073-byte record"),
        "{msg}"
    );

    // Oversized by one byte: still not a multiple.
    write(&bad, &vec![0u8; 10 * rec + 1]);
    let msg = data_error_naming(Cifar10::load(dir.path(), Split::Train).unwrap_err(), &bad);
    assert!(msg.contains("size 30731 is not a multiple"), "{msg}");

    // Oversized by whole records: more than a batch file holds.
    write(&bad, &vec![0u8; (Cifar10::RECORDS_PER_FILE + 1) * rec]);
    let msg = data_error_naming(Cifar10::load(dir.path(), Split::Train).unwrap_err(), &bad);
    assert!(msg.contains("10001 records"), "{msg}");

    // Empty.
    write(&bad, &[]);
    let msg = data_error_naming(Cifar10::load(dir.path(), Split::Train).unwrap_err(), &bad);
    assert!(msg.contains("empty"), "{msg}");

    // Label 10 in the second record.
    let mut bytes = cifar_record(1, 0);
    bytes.extend(cifar_record(10, 1));
    write(&bad, &bytes);
    let msg = data_error_naming(Cifar10::load(dir.path(), Split::Train).unwrap_err(), &bad);
    assert!(
        msg.contains("record 1") && msg.contains("label 10"),
        "{msg}"
    );

    // Missing file: names it and what belongs there.
    std::fs::remove_file(&bad).unwrap();
    let msg = data_error_naming(Cifar10::load(dir.path(), Split::Train).unwrap_err(), &bad);
    assert!(msg.contains("not found") && msg.contains("3073"), "{msg}");
    // The test split does not need the train files.
    assert!(Cifar10::load(dir.path(), Split::Test).is_ok());

    // Missing directory.
    let nowhere = dir.path().join("nowhere");
    let msg = data_error_naming(Cifar10::load(&nowhere, Split::Test).unwrap_err(), &nowhere);
    assert!(msg.contains("test_batch.bin"), "{msg}");
}

// ----- IDX (MNIST / Fashion-MNIST) -------------------------------------------------------

#[test]
fn idx_raw_and_gzipped_read_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let images = idx_images(5, 3, 4, IDX_IMAGES_MAGIC);
    let labels = idx_labels(&[3, 1, 4, 1, 5]);
    // Train files raw, test files gzipped: MnistKind::load finds either.
    write(&dir.path().join("train-images-idx3-ubyte"), &images);
    write(&dir.path().join("train-labels-idx1-ubyte"), &labels);
    write(
        &dir.path().join("t10k-images-idx3-ubyte.gz"),
        &gzip(&images),
    );
    write(
        &dir.path().join("t10k-labels-idx1-ubyte.gz"),
        &gzip(&labels),
    );
    let train = MnistKind::Mnist.load(dir.path(), Split::Train).unwrap();
    let test = MnistKind::FashionMnist
        .load(dir.path(), Split::Test)
        .unwrap();
    for set in [&train, &test] {
        assert_eq!(set.len(), 5);
        assert_eq!(set.image_shape(), [1, 3, 4]);
        assert_eq!(set.labels(), &[3, 1, 4, 1, 5]);
        assert_eq!(set.pixels(), &images[16..]);
    }
    let s = test.get(2).unwrap();
    assert_eq!(s.image.data(), &images[16 + 24..16 + 36]);
    assert_eq!(train.class_names()[4], "4");
    assert_eq!(test.class_names()[9], "Ankle boot");
}

#[test]
fn idx_bad_files_are_errors_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("images");
    let lab = dir.path().join("labels");
    let classes = MnistKind::Mnist.class_names();
    write(&lab, &idx_labels(&[0, 1, 2]));

    // Wrong magic: a label file where images belong (gzipped, to check the magic is read
    // after decompression).
    write(&img, &gzip(&idx_labels(&[0, 1, 2])));
    let msg = data_error_naming(load_idx(&img, &lab, classes.clone()).unwrap_err(), &img);
    assert!(
        msg.contains("magic number 2049") && msg.contains("not 2051"),
        "{msg}"
    );
    write(&img, &idx_images(3, 2, 2, 0x0000_0c03));
    let msg = data_error_naming(load_idx(&img, &lab, classes.clone()).unwrap_err(), &img);
    assert!(msg.contains("magic number 3075"), "{msg}");

    // Truncated images, and trailing bytes.
    let good = idx_images(3, 2, 2, IDX_IMAGES_MAGIC);
    write(&img, &good[..good.len() - 1]);
    let msg = data_error_naming(load_idx(&img, &lab, classes.clone()).unwrap_err(), &img);
    assert!(msg.contains("truncated"), "{msg}");
    let mut long = good.clone();
    long.push(0);
    write(&img, &long);
    let msg = data_error_naming(load_idx(&img, &lab, classes.clone()).unwrap_err(), &img);
    assert!(msg.contains("trailing"), "{msg}");
    // Shorter than a header.
    write(&img, &good[..10]);
    let msg = data_error_naming(load_idx(&img, &lab, classes.clone()).unwrap_err(), &img);
    assert!(msg.contains("header"), "{msg}");

    // Counts that differ between the two files.
    write(&img, &idx_images(4, 2, 2, IDX_IMAGES_MAGIC));
    let msg = data_error_naming(load_idx(&img, &lab, classes.clone()).unwrap_err(), &lab);
    assert!(
        msg.contains("3 labels") && msg.contains("4 images"),
        "{msg}"
    );

    // A label out of range.
    write(&img, &good);
    write(&lab, &idx_labels(&[0, 10, 2]));
    let msg = data_error_naming(load_idx(&img, &lab, classes.clone()).unwrap_err(), &lab);
    assert!(msg.contains("label 10 at index 1"), "{msg}");

    // Corrupt gzip.
    let mut gz = gzip(&idx_labels(&[0, 1, 2]));
    gz.truncate(gz.len() / 2);
    write(&lab, &gz);
    let msg = data_error_naming(load_idx(&img, &lab, classes.clone()).unwrap_err(), &lab);
    assert!(msg.contains("gzip"), "{msg}");

    // Missing files name the raw path and mention the .gz alternative.
    let err = MnistKind::Mnist.load(dir.path(), Split::Train).unwrap_err();
    let msg = data_error_naming(err, &dir.path().join("train-images-idx3-ubyte"));
    assert!(msg.contains(".gz"), "{msg}");
}

// ----- image folder ----------------------------------------------------------------------

/// root/<class>/<n>.png with 4x3 RGB images whose red channel is the class and green the
/// file number.
fn write_png_folder(root: &Path, classes: &[&str], per_class: usize) {
    for (k, class) in classes.iter().enumerate() {
        std::fs::create_dir_all(root.join(class)).unwrap();
        for n in 0..per_class {
            let path = root.join(class).join(format!("{n}.png"));
            write_png_rgb(&path, 4, 3, |x, y| {
                [k as u8 * 40, n as u8 * 50, (x + 4 * y) as u8]
            });
        }
    }
}

#[test]
fn image_folder_sorts_classes_and_files() {
    let dir = tempfile::tempdir().unwrap();
    // Written out of order: classes and files come back sorted by name.
    write_png_folder(dir.path(), &["zebra", "ant", "moose"], 3);
    // Not images, or hidden: ignored.
    write(&dir.path().join("ant").join("notes.txt"), b"hello");
    write(&dir.path().join("ant").join(".hidden.png"), b"junk");
    // A nested directory belongs to its class, after the class's own files.
    std::fs::create_dir_all(dir.path().join("ant/sub")).unwrap();
    std::fs::copy(
        dir.path().join("ant/0.png"),
        dir.path().join("ant/sub/a.PNG"),
    )
    .unwrap();

    let folder = ImageFolder::open(dir.path()).unwrap();
    assert_eq!(folder.class_names(), &["ant", "moose", "zebra"]);
    assert_eq!(folder.image_shape(), [3, 3, 4]);
    assert_eq!(folder.len(), 10);
    let names: Vec<String> = folder
        .files()
        .iter()
        .map(|(p, l)| {
            let rel = p.strip_prefix(dir.path()).unwrap();
            format!("{}:{l}", rel.display())
        })
        .collect();
    assert_eq!(
        names,
        [
            "ant/0.png:0",
            "ant/1.png:0",
            "ant/2.png:0",
            "ant/sub/a.PNG:0",
            "moose/0.png:1",
            "moose/1.png:1",
            "moose/2.png:1",
            "zebra/0.png:2",
            "zebra/1.png:2",
            "zebra/2.png:2",
        ]
    );
    // Pixels decode to CHW: zebra (written as class 0, red 0), file 1 (green 50).
    let s = folder.get(8).unwrap();
    assert_eq!(s.label, 2);
    assert_eq!(s.image.plane(0), &[0u8; 12]);
    assert_eq!(s.image.plane(1), &[50u8; 12]);
    assert_eq!(s.image.plane(2), &(0..12).collect::<Vec<u8>>()[..]);
    // Eager loading gives the same samples as lazy decoding.
    let loaded = folder.load().unwrap();
    for i in 0..folder.len() {
        assert_eq!(loaded.get(i).unwrap(), folder.get(i).unwrap());
    }
}

#[test]
fn image_folder_bad_images_are_errors_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    write_png_folder(dir.path(), &["a", "b"], 2);
    let bad = dir.path().join("b").join("1.png");
    write(&bad, b"\x89PNG\r\n\x1a\n not really a png");
    let folder = ImageFolder::open(dir.path()).unwrap();
    let msg = data_error_naming(folder.get(3).unwrap_err(), &bad);
    assert!(msg.contains("cannot decode"), "{msg}");
    let msg = data_error_naming(folder.load().unwrap_err(), &bad);
    assert!(msg.contains("cannot decode"), "{msg}");

    // An image of another size.
    write_png_rgb(&bad, 5, 3, |_, _| [0, 0, 0]);
    let folder = ImageFolder::open(dir.path()).unwrap();
    let msg = data_error_naming(folder.get(3).unwrap_err(), &bad);
    assert!(msg.contains("5x3") && msg.contains("4x3"), "{msg}");
    // A declared size all files miss.
    let folder = ImageFolder::open_with_size(dir.path(), 32, 32).unwrap();
    assert!(folder.get(0).is_err());

    // An empty class folder, and a root without classes.
    std::fs::create_dir(dir.path().join("c")).unwrap();
    let msg = data_error_naming(ImageFolder::open(dir.path()).unwrap_err(), dir.path());
    assert!(msg.contains("class folder(s) c"), "{msg}");
    let empty = tempfile::tempdir().unwrap();
    let msg = data_error_naming(ImageFolder::open(empty.path()).unwrap_err(), empty.path());
    assert!(msg.contains("no class subdirectories"), "{msg}");
    let nowhere: PathBuf = empty.path().join("nowhere");
    let msg = data_error_naming(ImageFolder::open(&nowhere).unwrap_err(), &nowhere);
    assert!(msg.contains("not found"), "{msg}");
}

/// JPEGs written by the `image` crate's encoder (tests/fixtures/images): a 9×6 grey ramp
/// `25x + 7y` and an RGB one `(25x, 40y, 99)`. Lossy (quality 75, the RGB one with 4:2:0
/// chroma subsampling across steep ramps): within 4 of the source for grey (measured 2),
/// 16 for RGB (measured 12); grey decodes to three equal channels. (The decoder gives exactly what `image` 0.25's
/// `decode().into_rgb8()` gave on all 10,000 CIFAR-10 test JPEGs: see `data/decode.rs`.)
#[test]
fn image_folder_decodes_jpeg() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/images");
    let dir = tempfile::tempdir().unwrap();
    for (class, file) in [("grey", "grey9x6.jpg"), ("rgb", "rgb9x6.jpg")] {
        std::fs::create_dir(dir.path().join(class)).unwrap();
        std::fs::copy(fixtures.join(file), dir.path().join(class).join(file)).unwrap();
    }
    let folder = ImageFolder::open(dir.path()).unwrap();
    let grey = folder.get(0).unwrap().image;
    let rgb = folder.get(1).unwrap().image;
    assert_eq!(grey.shape(), [3, 6, 9]);
    assert_eq!(rgb.shape(), [3, 6, 9]);
    assert_eq!(grey.plane(0), grey.plane(1));
    assert_eq!(grey.plane(0), grey.plane(2));
    for y in 0..6 {
        for x in 0..9 {
            let g = (x * 25 + y * 7) as u8;
            assert!(grey.get(0, y, x).abs_diff(g) <= 4, "grey ({x}, {y})");
            let want = [(x * 25) as u8, (y * 40) as u8, 99];
            for (c, w) in want.into_iter().enumerate() {
                assert!(rgb.get(c, y, x).abs_diff(w) <= 16, "rgb {c} ({x}, {y})");
            }
        }
    }
}

/// PNGs of every colour type and depth decode to 8-bit RGB by the rules of `image`'s
/// `into_rgb8`: grey copied to the three channels, alpha dropped, 16-bit samples rounded
/// as round(v·255/65535), sub-byte grey scaled up (v·255/(2^bits−1)), palettes looked up
/// (tRNS ignored).
#[test]
fn image_decoding_covers_every_png_colour_type_and_depth() {
    use png::{BitDepth as B, ColorType as C};
    let dir = tempfile::tempdir().unwrap();
    let (w, h) = (7u32, 5u32);
    let n = (w * h) as usize;
    let mut state = 0x9e37_79b9_u32;
    let mut bytes = |k: usize| -> Vec<u8> {
        (0..k)
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (state >> 24) as u8
            })
            .collect()
    };
    let wide = |d: &[u8], i: usize| {
        ((u32::from(d[2 * i]) << 8 | u32::from(d[2 * i + 1])) * 255 + 32767) / 65535
    };
    let mut cases: Vec<(String, Vec<u8>, Vec<u8>)> = Vec::new();
    let mut case =
        |name: &str, kind: (C, B), data: Vec<u8>, pal: Option<(&[u8], &[u8])>, want: Vec<u8>| {
            let path = dir.path().join(format!("{name}.png"));
            write_png_raw(&path, (w, h), kind, &data, pal);
            cases.push((name.to_string(), std::fs::read(&path).unwrap(), want));
        };
    for channels in 1..=4usize {
        let kind = [C::Grayscale, C::GrayscaleAlpha, C::Rgb, C::Rgba][channels - 1];
        for sixteen in [false, true] {
            let d = bytes(n * channels * if sixteen { 2 } else { 1 });
            let s = |i: usize| if sixteen { wide(&d, i) as u8 } else { d[i] };
            let want: Vec<u8> = (0..n)
                .flat_map(|p| {
                    let b = p * channels;
                    if channels < 3 {
                        [s(b); 3]
                    } else {
                        [s(b), s(b + 1), s(b + 2)]
                    }
                })
                .collect();
            let depth = if sixteen { B::Sixteen } else { B::Eight };
            case(
                &format!("c{channels}-{}", if sixteen { 16 } else { 8 }),
                (kind, depth),
                d,
                None,
                want,
            );
        }
    }
    for (depth, bits) in [(B::One, 1usize), (B::Two, 2), (B::Four, 4)] {
        let row = (w as usize * bits).div_ceil(8);
        let d = bytes(row * h as usize);
        let index = |x: usize, y: usize| {
            let bit = x * bits;
            (d[y * row + bit / 8] >> (8 - bits - bit % 8)) & ((1 << bits) - 1)
        };
        let max = (1u32 << bits) - 1;
        let grey: Vec<u8> = (0..n)
            .flat_map(|p| [(u32::from(index(p % w as usize, p / w as usize)) * 255 / max) as u8; 3])
            .collect();
        case(
            &format!("grey{bits}"),
            (C::Grayscale, depth),
            d.clone(),
            None,
            grey,
        );
        let palette = bytes(3 << bits);
        let trns = bytes(1);
        let want: Vec<u8> = (0..n)
            .flat_map(|p| {
                let i = usize::from(index(p % w as usize, p / w as usize));
                [palette[3 * i], palette[3 * i + 1], palette[3 * i + 2]]
            })
            .collect();
        case(
            &format!("palette{bits}"),
            (C::Indexed, depth),
            d,
            Some((&palette, &trns)),
            want,
        );
    }
    assert_eq!(cases.len(), 14);
    for (name, png, want) in cases {
        let img = hemi::data::parse_image(&png).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(img.shape(), [3, h as usize, w as usize], "{name}");
        let got: Vec<u8> = (0..n)
            .flat_map(|p| [0, 1, 2].map(|c| img.plane(c)[p]))
            .collect();
        assert_eq!(got, want, "{name}");
    }
    // Neither format: the error says so.
    let e = hemi::data::parse_image(b"GIF89a....")
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a JPEG or PNG"), "{e}");
}

// ----- synthetic -------------------------------------------------------------------------

#[test]
fn synthetic_is_deterministic_and_balanced() {
    let a = Synthetic::generate(7, Split::Train, 203);
    let b = Synthetic::generate(7, Split::Train, 203);
    let c = Synthetic::generate(8, Split::Train, 203);
    let t = Synthetic::generate(7, Split::Test, 203);
    assert_eq!(a.pixels(), b.pixels());
    assert_eq!(a.labels(), b.labels());
    assert_ne!(a.pixels(), c.pixels());
    assert_ne!(
        a.pixels(),
        t.pixels(),
        "train and test are different streams"
    );
    assert_eq!(a.image_shape(), [3, 32, 32]);
    assert_eq!(a.num_classes(), 10);
    // 203 = 20 * 10 + 3: the first three classes have one more image.
    assert_eq!(a.class_counts(), [21, 21, 21, 20, 20, 20, 20, 20, 20, 20]);
    // One image alone is the same bytes as in the generated set.
    assert_eq!(Synthetic::sample(7, Split::Train, 150), a.get(150).unwrap());
    // Images are not flat: every one spans a good part of the byte range.
    for i in 0..a.len() {
        let img = a.image_bytes(i);
        let (lo, hi) = (img.iter().min().unwrap(), img.iter().max().unwrap());
        assert!(hi - lo > 60, "image {i} spans only {lo}..{hi}");
    }
}

#[test]
fn synthetic_classes_are_not_separable_by_colour() {
    // The mean brightness of an image says nothing about its class: the per-class means
    // of the image means all lie close to the overall mean (colours are drawn uniformly).
    let set = Synthetic::generate(3, Split::Train, 2000);
    let mut sum = [0f64; 10];
    for i in 0..set.len() {
        let img = set.image_bytes(i);
        sum[set.labels()[i] as usize] += img.iter().map(|&v| v as f64).sum::<f64>() / 3072.0;
    }
    let means: Vec<f64> = sum.iter().map(|s| s / 200.0).collect();
    let overall = means.iter().sum::<f64>() / 10.0;
    for (k, m) in means.iter().enumerate() {
        assert!(
            (m - overall).abs() < 12.0,
            "class {k} mean {m} vs {overall}"
        );
    }
}

// ----- transforms ------------------------------------------------------------------------

fn ramp(c: usize, h: usize, w: usize) -> Image {
    Image::new(c, h, w, (0..c * h * w).map(|i| (i % 251) as u8).collect()).unwrap()
}

#[test]
fn to_float_and_normalize_values() {
    let img = ramp(3, 2, 3);
    let mut rng = Generator::new(0);
    let (plain, shape) = Transform::new().apply(&img, &mut rng).unwrap();
    assert_eq!(shape, [3, 2, 3]);
    for (v, &b) in plain.iter().zip(img.data()) {
        assert_eq!(*v, b as f32 / 255.0);
    }
    let (mean, std) = ([0.4914f32, 0.4822, 0.4465], [0.247f32, 0.243, 0.261]);
    let (norm, _) = Transform::new()
        .normalize(&mean, &std)
        .apply(&img, &mut rng)
        .unwrap();
    for (i, (v, &b)) in norm.iter().zip(img.data()).enumerate() {
        let c = i / 6;
        let want = (b as f64 / 255.0 - mean[c] as f64) / std[c] as f64;
        // The f32 formula: within a few ulps of the f64 value.
        assert!((*v as f64 - want).abs() < 1e-6 * want.abs().max(1.0), "{i}");
    }
    // The recipe's Normalize(0.5, 0.5) maps 0 -> -1 and 255 -> 1.
    let ends = Image::new(1, 1, 2, vec![0, 255]).unwrap();
    let (v, _) = Transform::to_tensor_normalize_half()
        .apply(&ends, &mut rng)
        .unwrap();
    assert_eq!(v, [-1.0, 1.0]);
    // A wrong number of channels or a zero std is an error, not a panic.
    assert!(Transform::new()
        .normalize(&[0.5, 0.5], &[0.5, 0.5])
        .apply(&img, &mut rng)
        .is_err());
    assert!(Transform::new()
        .normalize(&[0.5], &[0.0])
        .apply(&img, &mut rng)
        .is_err());
}

#[test]
fn crop_with_padding_shifts_content() {
    let img = ramp(2, 5, 6);
    // A window of the image's size at (padding, padding) is the image itself.
    let square = ramp(2, 5, 5);
    assert_eq!(crop_padded(&square, 5, 2, 2, 2).unwrap(), square);
    // Window at (0, 3) with padding 2: rows shift down by 2 (zeros above), columns left by 1.
    let out = crop_padded(&img, 4, 2, 0, 3).unwrap();
    for c in 0..2 {
        for y in 0..4 {
            for x in 0..4 {
                let (sy, sx) = (y as isize - 2, x as isize + 1);
                let want = if (0..5).contains(&sy) && (0..6).contains(&sx) {
                    img.get(c, sy as usize, sx as usize)
                } else {
                    0
                };
                assert_eq!(out.get(c, y, x), want, "c{c} y{y} x{x}");
            }
        }
    }
    // A window past the padded image is an error.
    assert!(crop_padded(&img, 4, 2, 6, 0).is_err());

    // RandomCrop(32, 4) draws every one of the 9 x 9 offsets, about uniformly.
    let img = ramp(3, 32, 32);
    let mut rng = Generator::new(5);
    let mut seen = HashSet::new();
    for _ in 0..2000 {
        let out = random_crop(&img, 32, 4, &mut rng).unwrap();
        assert_eq!(out.shape(), [3, 32, 32]);
        let found = (0..9)
            .flat_map(|t| (0..9).map(move |l| (t, l)))
            .find(|&(t, l)| crop_padded(&img, 32, 4, t, l).unwrap() == out)
            .expect("a crop is one of the 81 windows");
        seen.insert(found);
    }
    assert_eq!(seen.len(), 81);
    assert!(random_crop(&img, 41, 4, &mut rng).is_err());
}

#[test]
fn flip_mirrors_rows() {
    let img = ramp(3, 4, 5);
    let f = hflip(&img);
    for c in 0..3 {
        for y in 0..4 {
            for x in 0..5 {
                assert_eq!(f.get(c, y, x), img.get(c, y, 4 - x));
            }
        }
    }
    assert_eq!(hflip(&f), img);
    // p = 0 never flips, p = 1 always does, p = 0.5 about half the time.
    let mut rng = Generator::new(1);
    let never = Transform::new().random_horizontal_flip(0.0);
    let always = Transform::new().random_horizontal_flip(1.0);
    let half = Transform::new().random_horizontal_flip(0.5);
    assert_eq!(never.augment(&img, &mut rng).unwrap(), img);
    assert_eq!(always.augment(&img, &mut rng).unwrap(), f);
    let flips = (0..1000)
        .filter(|_| half.augment(&img, &mut rng).unwrap() == f)
        .count();
    // Binomial(1000, 0.5): sd 15.8, so 440..560 is beyond 3.7 sd.
    assert!((440..560).contains(&flips), "{flips} flips");
    assert!(Transform::new()
        .random_horizontal_flip(1.5)
        .augment(&img, &mut rng)
        .is_err());
}

#[test]
fn transforms_are_seeded() {
    let img = ramp(3, 32, 32);
    let t = Transform::cifar_train_augment();
    let run = |seed| {
        let mut rng = Generator::new(seed);
        (0..20)
            .map(|_| t.apply(&img, &mut rng).unwrap().0)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(3), run(3));
    assert_ne!(run(3), run(4));
}

// ----- loader ----------------------------------------------------------------------------

#[test]
fn loader_sees_every_sample_once_per_epoch() {
    let set = counting_set(1003, 7, [1, 2, 2]);
    for drop_last in [false, true] {
        let loader = DataLoader::new(
            set.clone(),
            LoaderConfig {
                drop_last,
                ..config(100, 3)
            },
        )
        .unwrap();
        assert_eq!(loader.num_batches(), if drop_last { 10 } else { 11 });
        for epoch in 0..3 {
            let batches = collect_epoch(&loader, epoch);
            assert_eq!(batches.len(), loader.num_batches());
            let mut seen = Vec::new();
            for (k, (images, labels, indices)) in batches.iter().enumerate() {
                let want_len = if k == 10 { 3 } else { 100 };
                assert_eq!(indices.len(), want_len);
                assert_eq!(images.len(), want_len * 4);
                // Each sample's label and pixels are its own.
                for (j, &i) in indices.iter().enumerate() {
                    assert_eq!(labels[j], (i % 7) as i64);
                    assert_eq!(images[j * 4], (i % 256) as f32 / 255.0);
                }
                seen.extend(indices);
            }
            let distinct: HashSet<usize> = seen.iter().copied().collect();
            assert_eq!(
                distinct.len(),
                seen.len(),
                "a sample twice in epoch {epoch}"
            );
            if drop_last {
                assert_eq!(seen.len(), 1000);
                assert_eq!(loader.samples_per_epoch(), 1000);
            } else {
                assert_eq!(distinct, (0..1003).collect());
            }
        }
    }
}

#[test]
fn loader_batches_are_tensors() {
    let set = counting_set(10, 3, [3, 4, 5]);
    let loader = DataLoader::new(set, config(4, 2)).unwrap();
    let b = loader.epoch(0).next().unwrap().unwrap();
    assert_eq!(b.images().unwrap().shape(), &[4, 3, 4, 5]);
    assert_eq!(b.images().unwrap().dtype(), DType::F32);
    assert_eq!(b.labels.shape(), &[4]);
    assert_eq!(b.labels.dtype(), DType::I64);
    assert_eq!(b.len(), 4);
    assert_eq!(loader.sample_shape(), Some([3, 4, 5]));
    // A transform that does not fit the data set is refused up front.
    let set = counting_set(10, 3, [3, 4, 5]);
    let cfg = LoaderConfig {
        transform: Transform::new().random_crop(32, 4),
        ..config(4, 0)
    };
    assert!(DataLoader::new(set.clone(), cfg).is_err());
    assert!(DataLoader::new(set, config(0, 0)).is_err());
}

#[test]
fn loader_shuffle_is_a_function_of_seed_and_epoch() {
    let set = counting_set(500, 10, [1, 1, 1]);
    let loader = DataLoader::new(set.clone(), config(64, 2)).unwrap();
    let again = DataLoader::new(set.clone(), config(64, 0)).unwrap();
    // Same (seed, epoch): same order, even from a fresh loader (a resumed run).
    assert_eq!(loader.order(4), again.order(4));
    assert_ne!(loader.order(4), loader.order(5));
    assert_ne!(loader.order(0), (0..500).collect::<Vec<_>>());
    let other_seed = DataLoader::new(
        set.clone(),
        LoaderConfig {
            seed: 12,
            ..config(64, 2)
        },
    )
    .unwrap();
    assert_ne!(loader.order(4), other_seed.order(4));
    // The batches follow the order.
    let indices: Vec<usize> = collect_epoch(&loader, 4)
        .into_iter()
        .flat_map(|b| b.2)
        .collect();
    assert_eq!(indices, loader.order(4));
    // Without shuffle: the data set's order every epoch.
    let plain = DataLoader::new(
        set,
        LoaderConfig {
            shuffle: false,
            ..config(64, 2)
        },
    )
    .unwrap();
    assert_eq!(plain.order(3), (0..500).collect::<Vec<_>>());
    // Resuming mid-epoch yields the rest of the epoch unchanged.
    let full = collect_epoch(&loader, 2);
    let rest: Vec<_> = loader
        .epoch_from(2, 3)
        .map(|b| b.unwrap().indices)
        .collect();
    assert_eq!(
        rest,
        full[3..].iter().map(|b| b.2.clone()).collect::<Vec<_>>()
    );
}

#[test]
fn loader_output_is_independent_of_worker_count() {
    let set: Arc<dyn Dataset> = Arc::new(Synthetic::generate(1, Split::Train, 300));
    let run = |workers| {
        let loader = DataLoader::new(
            set.clone(),
            LoaderConfig {
                transform: Transform::cifar_train_augment(),
                prefetch: 1,
                ..config(32, workers)
            },
        )
        .unwrap();
        (0..2)
            .flat_map(|e| collect_epoch(&loader, e))
            .collect::<Vec<_>>()
    };
    let one = run(1);
    assert_eq!(one, run(0));
    assert_eq!(one, run(4));
    assert_eq!(one, run(13), "more workers than batches");
    // The augmentation really is random: epochs differ for the same sample.
    let loader = DataLoader::new(
        set,
        LoaderConfig {
            transform: Transform::cifar_train_augment(),
            shuffle: false,
            ..config(300, 2)
        },
    )
    .unwrap();
    assert_ne!(
        collect_epoch(&loader, 0)[0].0,
        collect_epoch(&loader, 1)[0].0
    );
}

#[test]
fn loader_worker_errors_are_items_not_panics() {
    // An image folder with an undecodable file at a known position.
    let dir = tempfile::tempdir().unwrap();
    write_png_folder(dir.path(), &["a", "b"], 6);
    let bad = dir.path().join("b").join("2.png");
    write(&bad, b"garbage");
    let folder: Arc<dyn Dataset> = Arc::new(ImageFolder::open(dir.path()).unwrap());
    for workers in [0, 1, 3] {
        let loader = DataLoader::new(
            folder.clone(),
            LoaderConfig {
                shuffle: false,
                ..config(2, workers)
            },
        )
        .unwrap();
        let items: Vec<_> = loader.epoch(0).collect();
        // File b/2.png is sample 8, in batch 4: batches 0..3 arrive, then the error, then
        // the epoch ends.
        assert_eq!(items.len(), 5, "workers {workers}");
        assert!(items[..4].iter().all(Result::is_ok));
        let msg = items[4].as_ref().unwrap_err().to_string();
        assert!(msg.contains(&bad.display().to_string()), "{msg}");
    }
    // Dropping an epoch half-way stops its workers (the test would hang otherwise).
    let set = counting_set(5000, 2, [1, 8, 8]);
    let loader = DataLoader::new(set, config(10, 4)).unwrap();
    let mut epoch = loader.epoch(0);
    assert!(epoch.next().unwrap().is_ok());
    drop(epoch);
}

/// A data set whose `get` panics at one index.
struct Panicky;
impl Dataset for Panicky {
    fn len(&self) -> usize {
        8
    }
    fn get(&self, index: usize) -> hemi::Result<Sample> {
        assert!(index != 5, "sample 5 is cursed");
        Ok(Sample {
            image: Image::zeros(1, 1, 1),
            label: 0,
        })
    }
    fn class_names(&self) -> &[String] {
        static NAMES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
        NAMES.get_or_init(|| vec!["x".to_string()])
    }
    fn image_shape(&self) -> [usize; 3] {
        [1, 1, 1]
    }
}

#[test]
fn loader_reports_a_panicking_worker_as_an_error() {
    let loader = DataLoader::new(
        Arc::new(Panicky),
        LoaderConfig {
            shuffle: false,
            ..config(2, 2)
        },
    )
    .unwrap();
    let items: Vec<_> = loader.epoch(0).collect();
    assert_eq!(items.len(), 3);
    assert!(items[0].is_ok() && items[1].is_ok());
    let msg = items[2].as_ref().unwrap_err().to_string();
    assert!(msg.contains("worker 0") && msg.contains("cursed"), "{msg}");
}

// ----- measurements (run by hand) --------------------------------------------------------
//
// HEMI_CIFAR_JPEG=/tmp/cifar cargo test -p hemi --release --test io -- --ignored --nocapture
// with the real CIFAR-10 image folder extracted to /tmp/cifar (train/, test/).

fn cifar_jpeg_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("HEMI_CIFAR_JPEG")?);
    Some(dir)
}

/// CPU seconds this process has used (user + system), from /proc/self/stat (Linux): the
/// machine is shared, so images per CPU-second is the figure that does not depend on load.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<f64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    if f.len() < 13 {
        return f64::NAN;
    }
    (f[11] + f[12]) / 100.0 // USER_HZ is 100 on Linux
}

/// Runs `f` over `n` images and prints wall and CPU rates.
fn report(what: &str, n: usize, f: impl FnOnce()) {
    let (wall, cpu) = (std::time::Instant::now(), cpu_seconds());
    f();
    let (wall, cpu) = (wall.elapsed().as_secs_f64(), cpu_seconds() - cpu);
    eprintln!(
        "{what}: {n} images in {wall:.2} s wall, {cpu:.2} s CPU: {:.0} images/s, {:.0} images per CPU-second",
        n as f64 / wall,
        n as f64 / cpu
    );
}

/// Drains one epoch of a loader over `set`.
fn drain(set: Arc<dyn Dataset>, workers: usize, transform: Transform) -> usize {
    let loader = DataLoader::new(
        set,
        LoaderConfig {
            batch_size: 128,
            workers,
            transform,
            ..LoaderConfig::default()
        },
    )
    .unwrap();
    loader.epoch(0).map(|b| b.unwrap().len()).sum()
}

#[test]
#[ignore = "measurement on the real CIFAR-10 JPEG folder (HEMI_CIFAR_JPEG)"]
fn measure_cifar_jpeg_loading() {
    let Some(dir) = cifar_jpeg_dir() else {
        eprintln!("HEMI_CIFAR_JPEG not set");
        return;
    };
    let start = std::time::Instant::now();
    let folder = ImageFolder::open(&dir.join("train")).unwrap();
    eprintln!(
        "scan: {} files in {:.2} s",
        folder.len(),
        start.elapsed().as_secs_f64()
    );
    assert_eq!(folder.class_names(), CIFAR10_CLASSES);
    let n = folder.len();
    let folder: Arc<dyn Dataset> = Arc::new(folder);
    let aug = Transform::cifar_train_augment;
    report(
        "lazy JPEG decode in 2 workers, crop+flip+normalize",
        n,
        || {
            assert_eq!(drain(folder.clone(), 2, aug()), n);
        },
    );
    let mut train = None;
    report(
        &format!(
            "decode all (rayon, {} threads)",
            rayon::current_num_threads()
        ),
        n,
        || {
            let f = ImageFolder::open(&dir.join("train")).unwrap();
            train = Some(f.load().unwrap());
        },
    );
    let train = train.unwrap();
    assert_eq!(train.class_counts(), [5000; 10]);
    let train: Arc<dyn Dataset> = Arc::new(train);
    for workers in [0, 1, 2] {
        report(
            &format!("in memory, {workers} workers, crop+flip+normalize"),
            n,
            || assert_eq!(drain(train.clone(), workers, aug()), n),
        );
    }
    report("in memory, 2 workers, normalize only", n, || {
        drain(train.clone(), 2, Transform::to_tensor_normalize_half());
    });
}

#[test]
#[ignore = "measurement: synthetic generation time"]
fn measure_synthetic_generation() {
    let train_len = std::env::var("HEMI_SYNTHETIC_TRAIN_LEN")
        .map_or(Synthetic::DEFAULT_TRAIN_LEN, |s| s.parse().unwrap());
    let (mut train, mut test) = (None, None);
    let n = train_len + Synthetic::DEFAULT_TEST_LEN;
    report("synthetic generation (rayon)", n, || {
        train = Some(Synthetic::generate(0, Split::Train, train_len));
        test = Some(Synthetic::generate(
            0,
            Split::Test,
            Synthetic::DEFAULT_TEST_LEN,
        ));
    });
    let (train, test) = (train.unwrap(), test.unwrap());
    // HEMI_SYNTHETIC_OUT=DIR also writes them in CIFAR-10's binary layout (for checking
    // the set's difficulty with another framework).
    if let Some(out) = std::env::var_os("HEMI_SYNTHETIC_OUT") {
        let out = PathBuf::from(out);
        std::fs::create_dir_all(&out).unwrap();
        for (set, name) in [(&train, "data_batch_1.bin"), (&test, "test_batch.bin")] {
            let bytes: Vec<u8> = (0..set.len())
                .flat_map(|i| {
                    std::iter::once(set.labels()[i] as u8).chain(set.image_bytes(i).to_vec())
                })
                .collect();
            write(&out.join(name), &bytes);
        }
    }
}

#[test]
#[ignore = "check on the real Fashion-MNIST files (HEMI_FASHION_MNIST=DIR of the .gz files)"]
fn measure_fashion_mnist() {
    let Some(dir) = std::env::var_os("HEMI_FASHION_MNIST") else {
        eprintln!("HEMI_FASHION_MNIST not set");
        return;
    };
    let dir = PathBuf::from(dir);
    let mut sets = Vec::new();
    report(
        "Fashion-MNIST train + test (gunzip + check)",
        70_000,
        || {
            for split in [Split::Train, Split::Test] {
                sets.push(MnistKind::FashionMnist.load(&dir, split).unwrap());
            }
        },
    );
    assert_eq!(sets[0].len(), 60_000);
    assert_eq!(sets[1].len(), 10_000);
    assert_eq!(sets[0].image_shape(), [1, 28, 28]);
    assert_eq!(sets[0].class_counts(), [6000; 10]);
    assert_eq!(sets[1].class_counts(), [1000; 10]);
}
