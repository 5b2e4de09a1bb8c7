//! The unit tests of `hemi::io::tensorboard` (`src/io/tensorboard.rs`), run against the built library.

use hemi::io::tensorboard::*;

#[test]
// The mask written out as TensorFlow states it, independently of `masked_crc`'s rotate.
#[allow(clippy::manual_rotate)]
fn masked_crc_of_known_bytes() {
    // CRC-32C("123456789") = 0xE3069283 (RFC 3720's check value), then masked.
    let crc: u32 = 0xE306_9283;
    assert_eq!(crc32c::crc32c(b"123456789"), crc);
    assert_eq!(
        masked_crc(b"123456789"),
        ((crc >> 15) | (crc << 17)).wrapping_add(0xa282_ead8)
    );
}

#[test]
fn histogram_counts_every_finite_value_once() {
    let v: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 - 50.0).collect();
    let mut with_bad = v.clone();
    with_bad.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY]);
    let h = histogram(&with_bad);
    assert_eq!(h.num, 1000.0);
    assert_eq!(h.bucket.iter().sum::<f64>(), 1000.0);
    assert_eq!((h.min, h.max), (-50.0, 50.0));
    assert_eq!(*h.bucket_limit.last().unwrap(), 50.0);
    let sum: f64 = v.iter().map(|&x| f64::from(x)).sum();
    assert_eq!(h.sum, sum);
    // Each bucket holds exactly the values in (limit[i-1], limit[i]].
    for (i, (&lim, &n)) in h.bucket_limit.iter().zip(&h.bucket).enumerate() {
        let lo = if i == 0 {
            f64::NEG_INFINITY
        } else {
            h.bucket_limit[i - 1]
        };
        let want = v
            .iter()
            .filter(|&&x| f64::from(x) > lo && f64::from(x) <= lim)
            .count();
        assert_eq!(n, want as f64, "bucket {i}");
    }
    let c = histogram(&[2.5; 7]);
    assert_eq!(
        (c.bucket_limit.clone(), c.bucket.clone()),
        (vec![2.5], vec![7.0])
    );
    assert_eq!(histogram(&[f32::NAN]).num, 0.0);
}

#[test]
fn records_round_trip_and_corruption_is_named() {
    let payloads: Vec<Vec<u8>> = vec![vec![], b"abc".to_vec(), vec![7u8; 300]];
    let bytes: Vec<u8> = payloads.iter().flat_map(|p| encode_record(p)).collect();
    assert_eq!(decode_records(&bytes, "f").unwrap(), payloads);
    let e = decode_records(&bytes[..bytes.len() - 1], "f").unwrap_err();
    assert!(e.to_string().contains("truncated payload"), "{e}");
    let mut bad = bytes.clone();
    bad[16 + 12 + 1] ^= 1; // inside the second payload ("abc" at 28..31)
    let e = decode_records(&bad, "f").unwrap_err();
    assert!(
        e.to_string().contains("record at byte 16: payload CRC"),
        "{e}"
    );
    let mut bad = bytes;
    bad[0] ^= 1;
    let e = decode_records(&bad, "f").unwrap_err();
    assert!(e.to_string().contains("length CRC"), "{e}");
}
