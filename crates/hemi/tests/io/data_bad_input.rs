//! Bad input to the data readers (issue 11): mismatched train/test folders, symlink loops,
//! FIFOs, sizes that overflow or exceed the file, partial CIFAR-10 copies, failed fetches,
//! corrupt safetensors. Each must be an `Error` naming the file or directory and the
//! problem — never a panic, a hang or a silently wrong data set.

use std::io::Write;
use std::path::{Path, PathBuf};

use hemi::data::*;
use hemi::Error;

// ----- helpers ---------------------------------------------------------------------------

fn write(path: &Path, bytes: &[u8]) {
    std::fs::File::create(path)
        .unwrap()
        .write_all(bytes)
        .unwrap();
}

/// The error's message, which must name every one of `paths`.
fn error_naming(err: Error, paths: &[&Path]) -> String {
    let msg = err.to_string();
    for path in paths {
        assert!(
            msg.contains(&path.display().to_string()),
            "error does not name {}: {msg}",
            path.display()
        );
    }
    msg
}

/// root/<class>/<n>.png, `per_class` RGB images of `w x h` per class.
fn png_folder(root: &Path, classes: &[&str], per_class: usize, w: u32, h: u32) {
    for class in classes {
        std::fs::create_dir_all(root.join(class)).unwrap();
        for n in 0..per_class {
            png(&root.join(class).join(format!("{n}.png")), w, h);
        }
    }
}

fn png(path: &Path, w: u32, h: u32) {
    crate::common::write_png_rgb(path, w, h, |x, y| [x as u8, y as u8, 7]);
}

/// A FIFO at `path` (nothing ever writes to it: opening it for reading blocks forever).
fn fifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let ok = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap()
        .success();
    assert!(ok, "mkfifo {}", path.display());
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

// ----- 1. train and test folders opened together ----------------------------------------

#[test]
fn image_folder_pair_with_a_missing_or_extra_class_names_both_dirs_and_the_classes() {
    let dir = tempfile::tempdir().unwrap();
    let (train, test) = (dir.path().join("train"), dir.path().join("test"));
    png_folder(&train, &["bird", "cat", "dog"], 2, 4, 3);
    png_folder(&test, &["bird", "dog"], 1, 4, 3);
    // Alone, each opens: the mismatch only shows when they are opened as a pair.
    assert!(ImageFolder::open(&test).is_ok());
    let e = ImageFolder::open_pair(&train, &test).unwrap_err();
    let msg = error_naming(e, &[&train, &test]);
    assert!(
        msg.contains("only in train: cat") && msg.contains("only in test: none"),
        "{msg}"
    );

    // An extra class in test (the `cross_entropy: index 10` an epoch later).
    png_folder(&test, &["cat", "emu"], 1, 4, 3);
    let msg = error_naming(
        ImageFolder::open_pair(&train, &test).unwrap_err(),
        &[&train, &test],
    );
    assert!(
        msg.contains("only in train: none") && msg.contains("only in test: emu"),
        "{msg}"
    );

    std::fs::remove_dir_all(test.join("emu")).unwrap();
    let (tr, te) = ImageFolder::open_pair(&train, &test).unwrap();
    assert_eq!(tr.class_names(), te.class_names());
    assert_eq!((tr.len(), te.len()), (6, 3));
    assert_eq!(te.image_shape(), [3, 3, 4]);
}

#[test]
fn image_folder_pair_reports_an_odd_sized_image_by_name_with_both_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let (train, test) = (dir.path().join("train"), dir.path().join("test"));
    png_folder(&train, &["a", "b"], 3, 4, 3);
    png_folder(&test, &["a", "b"], 2, 4, 3);
    // The odd one sorts first, so a reference size taken from the first file would blame
    // every other image instead.
    let odd = train.join("a").join("0.png");
    png(&odd, 6, 5);
    let msg = error_naming(ImageFolder::open_pair(&train, &test).unwrap_err(), &[&odd]);
    assert!(msg.contains("6x5") && msg.contains("4x3"), "{msg}");

    // A test image of another size than the training images.
    png(&odd, 4, 3);
    let odd = test.join("b").join("1.png");
    png(&odd, 8, 8);
    let msg = error_naming(ImageFolder::open_pair(&train, &test).unwrap_err(), &[&odd]);
    assert!(msg.contains("8x8") && msg.contains("4x3"), "{msg}");
}

#[test]
fn image_folder_pair_with_an_empty_test_set_names_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    let (train, test) = (dir.path().join("train"), dir.path().join("test"));
    png_folder(&train, &["a", "b"], 1, 4, 3);
    std::fs::create_dir_all(test.join("a")).unwrap();
    std::fs::create_dir_all(test.join("b")).unwrap();
    let msg = error_naming(ImageFolder::open_pair(&train, &test).unwrap_err(), &[&test]);
    assert!(msg.contains("no .jpg/.jpeg/.png files"), "{msg}");
    std::fs::remove_dir_all(&test).unwrap();
    std::fs::create_dir_all(&test).unwrap();
    let msg = error_naming(ImageFolder::open_pair(&train, &test).unwrap_err(), &[&test]);
    assert!(msg.contains("no class subdirectories"), "{msg}");
}

// ----- 2. symlinks ----------------------------------------------------------------------

#[cfg(unix)]
#[test]
fn image_folder_does_not_follow_symlinked_directories() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("train");
    png_folder(&root, &["cat", "dog"], 3, 4, 3);
    // A loop: train/cat/loop -> .. (which holds cat/ and dog/ again, and loop again...).
    let link = root.join("cat").join("loop");
    symlink("..", &link).unwrap();
    // A symlinked file is read as the file it points to.
    symlink(root.join("dog/0.png"), root.join("cat/zz.png")).unwrap();
    // A symlinked class directory is not a class.
    let outside = dir.path().join("elsewhere");
    png_folder(&outside, &["emu"], 2, 4, 3);
    let class_link = root.join("emu");
    symlink(outside.join("emu"), &class_link).unwrap();

    let folder = ImageFolder::open(&root).unwrap();
    assert_eq!(folder.class_names(), &["cat", "dog"]);
    assert_eq!(folder.len(), 7, "{:?}", folder.files());
    assert!(folder
        .files()
        .iter()
        .all(|(p, _)| !p.starts_with(&link) && !p.starts_with(&class_link)));
    assert_eq!(folder.skipped(), &[link.clone(), class_link.clone()]);

    // A class holding nothing but a symlinked directory is empty, and says why.
    std::fs::remove_dir_all(root.join("dog")).unwrap();
    std::fs::create_dir(root.join("dog")).unwrap();
    symlink(&root, root.join("dog").join("up")).unwrap();
    let msg = error_naming(ImageFolder::open(&root).unwrap_err(), &[&root]);
    assert!(
        msg.contains("class folder(s) dog") && msg.contains("symbolic link"),
        "{msg}"
    );
}

// ----- 3. FIFOs and other non-regular files ---------------------------------------------

#[cfg(unix)]
#[test]
fn fifos_as_data_files_are_errors_not_hangs() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();

    // CIFAR-10: a FIFO in place of test_batch.bin.
    for f in Cifar10::file_names(Split::Train) {
        write(&d.join(f), &[0u8; 3073]);
    }
    let batch = d.join("test_batch.bin");
    fifo(&batch);
    let msg = error_naming(Cifar10::load(d, Split::Test).unwrap_err(), &[&batch]);
    assert!(
        msg.contains("not a regular file") && msg.contains("FIFO"),
        "{msg}"
    );
    let msg = error_naming(Cifar10::probe(d).unwrap_err(), &[&batch]);
    assert!(msg.contains("not a regular file"), "{msg}");

    // MNIST: raw, and gzipped, image files that are FIFOs; a direct read of a label FIFO.
    let images = d.join("t10k-images-idx3-ubyte");
    fifo(&images);
    let msg = error_naming(
        MnistKind::Mnist.load(d, Split::Test).unwrap_err(),
        &[&images],
    );
    assert!(msg.contains("not a regular file"), "{msg}");
    std::fs::remove_file(&images).unwrap();
    let gz = d.join("t10k-images-idx3-ubyte.gz");
    fifo(&gz);
    let msg = error_naming(MnistKind::Mnist.load(d, Split::Test).unwrap_err(), &[&gz]);
    assert!(msg.contains("not a regular file"), "{msg}");
    let labels = d.join("labels-fifo");
    fifo(&labels);
    let msg = error_naming(read_idx_labels(&labels).unwrap_err(), &[&labels]);
    assert!(msg.contains("FIFO"), "{msg}");

    // An image folder whose first (size-defining) image is a FIFO.
    let root = d.join("images");
    png_folder(&root, &["a"], 2, 4, 3);
    let img = root.join("a").join("0.png");
    fifo(&img);
    let msg = error_naming(ImageFolder::open(&root).unwrap_err(), &[&img]);
    assert!(msg.contains("not a regular file"), "{msg}");

    // A safetensors file.
    let st = d.join("model.safetensors");
    fifo(&st);
    let msg = error_naming(hemi::io::load_safetensors(&st).unwrap_err(), &[&st]);
    assert!(msg.contains("not a regular file"), "{msg}");
}

// ----- 4. sizes: checked products, nothing allocated beyond the file --------------------

#[test]
fn synthetic_size_is_checked() {
    let msg = Synthetic::try_generate(0, Split::Train, usize::MAX)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("18446744073709551615") && msg.contains("Synthetic"),
        "{msg}"
    );
    assert!(Synthetic::try_generate(0, Split::Train, 0).is_err());
    assert_eq!(
        Synthetic::try_generate(0, Split::Train, 12).unwrap().len(),
        12
    );
}

#[test]
fn overflowing_shapes_are_errors() {
    // (2^32 + 1)^2 wraps to 2^33 + 1 in 64 bits; 0 images of that would pass unchecked.
    let big = (1usize << 32) + 1;
    let e = InMemoryDataset::new([big, big, 1], vec![], vec![], vec!["a".into()]).unwrap_err();
    assert!(e.to_string().contains("InMemoryDataset::new"), "{e}");
    // 2^32 * 2^32 wraps to 0, matching an empty buffer.
    let e = Image::new(1 << 32, 1 << 32, 1, vec![]).unwrap_err();
    assert!(e.to_string().contains("Image::new"), "{e}");
}

#[test]
fn idx_headers_claiming_more_than_the_file_holds_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    // Raw: 2^32-1 images of 2^32-1 x 2^32-1 overflow even 64 bits.
    let raw = dir.path().join("huge-idx3-ubyte");
    let mut b = Vec::new();
    for w in [IDX_IMAGES_MAGIC, u32::MAX, u32::MAX, u32::MAX] {
        b.extend(w.to_be_bytes());
    }
    write(&raw, &b);
    let msg = error_naming(read_idx_images(&raw).unwrap_err(), &[&raw]);
    assert!(
        msg.contains("overflowing") && msg.contains("truncated"),
        "{msg}"
    );

    // Gzipped: a header claiming 4 billion labels in a 30-byte gzip file is refused
    // from the header, before anything is decompressed or allocated.
    let gz = dir.path().join("huge-labels.gz");
    let mut b = Vec::new();
    b.extend(IDX_LABELS_MAGIC.to_be_bytes());
    b.extend(u32::MAX.to_be_bytes());
    b.extend([1, 2, 3]);
    write(&gz, &gzip(&b));
    let msg = error_naming(read_idx_labels(&gz).unwrap_err(), &[&gz]);
    assert!(
        msg.contains("4294967295") && msg.contains("can hold"),
        "{msg}"
    );

    // A decompression bomb: 2 labels, then 64 MiB of zeros that deflate to 64 KiB. Only the
    // header and what it claims (plus one byte) are decompressed.
    let mut b = Vec::new();
    b.extend(IDX_LABELS_MAGIC.to_be_bytes());
    b.extend(2u32.to_be_bytes());
    b.extend(vec![0u8; 64 << 20]);
    let bomb = dir.path().join("bomb.gz");
    write(&bomb, &gzip(&b));
    let msg = error_naming(read_idx_labels(&bomb).unwrap_err(), &[&bomb]);
    assert!(msg.contains("trailing"), "{msg}");
}

#[test]
fn an_oversized_cifar_file_is_refused_before_it_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for f in Cifar10::file_names(Split::Train) {
        write(&d.join(f), &[0u8; 3073]);
    }
    // A sparse 1 TiB file: reading it first would allocate 1 TiB.
    let batch = d.join("test_batch.bin");
    std::fs::File::create(&batch)
        .unwrap()
        .set_len(1 << 40)
        .unwrap();
    let msg = error_naming(Cifar10::load(d, Split::Test).unwrap_err(), &[&batch]);
    assert!(msg.contains("size 1099511627776"), "{msg}");
}

// ----- 5. CIFAR-10 partially present ----------------------------------------------------

#[test]
fn cifar10_probe_tells_partial_from_absent() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    assert_eq!(Cifar10::probe(d).unwrap(), None);
    for f in Cifar10::file_names(Split::Train) {
        write(&d.join(f), &[0u8; 3073]);
    }
    // Only test_batch.bin missing: `locate` says "no CIFAR-10"; `probe` names the gap.
    assert_eq!(Cifar10::locate(d), None);
    let msg = error_naming(Cifar10::probe(d).unwrap_err(), &[d]);
    assert!(
        msg.contains("missing test_batch.bin") && msg.contains("data_batch_5.bin"),
        "{msg}"
    );
    write(&d.join("test_batch.bin"), &[0u8; 3073]);
    assert_eq!(Cifar10::probe(d).unwrap(), Some(d.to_path_buf()));

    // The official archive's subdirectory, missing two training batches.
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("cifar-10-batches-bin");
    std::fs::create_dir(&sub).unwrap();
    for f in ["data_batch_1.bin", "data_batch_2.bin", "data_batch_4.bin"] {
        write(&sub.join(f), &[0u8; 3073]);
    }
    write(&sub.join("test_batch.bin"), &[0u8; 3073]);
    let msg = error_naming(Cifar10::probe(dir.path()).unwrap_err(), &[&sub]);
    assert!(
        msg.contains("missing data_batch_3.bin, data_batch_5.bin"),
        "{msg}"
    );
}

// ----- 6. a failed fetch leaves nothing behind ------------------------------------------

#[test]
fn a_failed_fetch_removes_the_directories_it_created_and_only_those() {
    let dir = tempfile::tempdir().unwrap();
    // Port 9 (discard) on loopback: nothing listens, the connection is refused at once.
    let url = "http://127.0.0.1:9/cifar-10-binary.tar.gz";
    let data_dir: PathBuf = dir.path().join("a").join("b").join("data");
    let e = fetch_archive(&data_dir, url, CIFAR10_SHA256, None).unwrap_err();
    assert!(e.to_string().contains("could not download"), "{e}");
    assert!(
        !dir.path().join("a").exists(),
        "created directories are left"
    );
    assert!(dir.path().exists());

    // A directory that existed (with a file of the user's) stays as it was.
    let mine = dir.path().join("mine");
    std::fs::create_dir(&mine).unwrap();
    write(&mine.join("notes.txt"), b"keep");
    assert!(fetch_archive(&mine, url, CIFAR10_SHA256, None).is_err());
    let names: Vec<_> = std::fs::read_dir(&mine)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["notes.txt"]);
}

// ----- 7. safetensors -------------------------------------------------------------------

#[test]
fn corrupt_safetensors_files_are_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let t = hemi::Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
    hemi::io::save_safetensors(&path, &[("w".into(), t)], None).unwrap();
    let good = std::fs::read(&path).unwrap();
    assert!(hemi::io::load_safetensors(&path).is_ok());

    let mut cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", vec![]),
        ("truncated header length", good[..5].to_vec()),
        ("truncated header", good[..20].to_vec()),
        ("truncated data", good[..good.len() - 3].to_vec()),
    ];
    // A header length of 2^64 - 1.
    let mut huge = good.clone();
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    cases.push(("huge header length", huge));
    // A shape whose element count overflows, over the same 16 bytes.
    let header = br#"{"w":{"dtype":"F32","shape":[4294967297,4294967297],"data_offsets":[0,16]}}"#;
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend(header);
    b.extend([0u8; 16]);
    cases.push(("overflowing shape", b));
    for (what, bytes) in cases {
        write(&path, &bytes);
        let e = hemi::io::load_safetensors(&path).unwrap_err();
        let msg = error_naming(e, &[&path]);
        assert!(msg.contains("safetensors"), "{what}: {msg}");
    }
}
