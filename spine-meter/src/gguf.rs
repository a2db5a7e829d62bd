//! A reader for the key–value metadata at the head of a GGUF model file.
//!
//! Layout (ggml `docs/gguf.md`, versions 2 and 3, little-endian): magic `GGUF`, `u32` version,
//! `u64` tensor count, `u64` KV count, then each KV as a string key (`u64` length + UTF-8 bytes), a
//! `u32` value type and the value. Reading stops after the last KV: tensor infos and tensor data
//! are never read.
//!
//! The bytes are untrusted. Every length is checked against [`GgufLimits`] before anything is
//! allocated, the whole header may not exceed [`GgufLimits::max_header_bytes`], nothing panics,
//! and every failure is a [`GgufError`] that says where it happened.

use std::io::Read;
use std::path::Path;

use indexmap::IndexMap;

/// Caps applied while reading untrusted GGUF bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GgufLimits {
    /// Most bytes read in total (the header region), bytes. Default 256 MiB.
    pub max_header_bytes: u64,
    /// Longest string (key or value), bytes. Default 16 MiB.
    pub max_string_bytes: u64,
    /// Most KV pairs. Default 65 536.
    pub max_kv_count: u64,
    /// Most elements in one array. Default 4 Mi.
    pub max_array_len: u64,
    /// Deepest nesting of arrays. Default 4.
    pub max_array_depth: u32,
}

impl Default for GgufLimits {
    fn default() -> Self {
        Self {
            max_header_bytes: 256 * 1024 * 1024,
            max_string_bytes: 16 * 1024 * 1024,
            max_kv_count: 65_536,
            max_array_len: 4 * 1024 * 1024,
            max_array_depth: 4,
        }
    }
}

/// Why a GGUF header could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// Reading the file failed.
    #[error("gguf i/o error")]
    Io(#[source] std::io::Error),
    /// The input ended inside the header.
    #[error("gguf header truncated at byte {offset}")]
    Truncated {
        /// Bytes read before the end.
        offset: u64,
    },
    /// The file does not start with `GGUF`.
    #[error("not a gguf file (bad magic)")]
    BadMagic,
    /// A version other than 2 or 3.
    #[error("unsupported gguf version {0}")]
    UnsupportedVersion(u32),
    /// A value type outside the specification.
    #[error("unknown gguf value type {value_type} at byte {offset}")]
    UnknownType {
        /// The type tag read.
        value_type: u32,
        /// Where it was read.
        offset: u64,
    },
    /// A string is not valid UTF-8.
    #[error("gguf string at byte {offset} is not valid utf-8")]
    InvalidUtf8 {
        /// Where the string starts.
        offset: u64,
    },
    /// A count or length is over a [`GgufLimits`] cap.
    #[error("gguf {what} of {value} at byte {offset} is over the limit of {limit}")]
    OverLimit {
        /// Which cap.
        what: &'static str,
        /// The value read.
        value: u64,
        /// The cap.
        limit: u64,
        /// Where it was read.
        offset: u64,
    },
    /// The same key appears twice.
    #[error("gguf key {0:?} appears twice")]
    DuplicateKey(String),
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum GgufValue {
    /// Any unsigned integer type (`u8`, `u16`, `u32`, `u64`).
    Uint(u64),
    /// Any signed integer type (`i8`, `i16`, `i32`, `i64`).
    Int(i64),
    /// `f32` or `f64`.
    Float(f64),
    /// `bool`.
    Bool(bool),
    /// `string`.
    String(String),
    /// `array`.
    Array(GgufArray),
}

/// A homogeneous array value, stored compactly by element kind.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum GgufArray {
    /// Unsigned integers.
    Uint(Vec<u64>),
    /// Signed integers.
    Int(Vec<i64>),
    /// Floats.
    Float(Vec<f64>),
    /// Booleans.
    Bool(Vec<bool>),
    /// Strings.
    String(Vec<String>),
    /// Nested arrays.
    Array(Vec<GgufArray>),
}

impl GgufValue {
    /// The value as an unsigned integer, when it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Self::Uint(v) => Some(*v),
            Self::Int(v) => u64::try_from(*v).ok(),
            _ => None,
        }
    }

    /// The value as a string slice, when it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }
}

/// The metadata of one GGUF file, in file order.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufMetadata {
    version: u32,
    tensor_count: u64,
    kv: IndexMap<String, GgufValue>,
}

impl GgufMetadata {
    /// Reads the header of the file at `path` with default limits.
    ///
    /// # Errors
    ///
    /// [`GgufError`] when the file cannot be opened or its header is malformed or over a limit.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let file = std::fs::File::open(path).map_err(GgufError::Io)?;
        Self::read_from(std::io::BufReader::new(file), GgufLimits::default())
    }

    /// Reads a header from bytes in memory with default limits; the entry point for fuzzing.
    ///
    /// # Errors
    ///
    /// [`GgufError`] when the header is malformed or over a limit.
    pub fn parse(bytes: &[u8]) -> Result<Self, GgufError> {
        Self::read_from(bytes, GgufLimits::default())
    }

    /// Reads a header from `reader`, consuming only the header region.
    ///
    /// # Errors
    ///
    /// [`GgufError`] when reading fails or the header is malformed or over a limit.
    pub fn read_from<R: Read>(reader: R, limits: GgufLimits) -> Result<Self, GgufError> {
        let mut r = Reader {
            inner: reader,
            offset: 0,
            limits,
        };
        let magic = r.bytes4()?;
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic);
        }
        let version = u32::from_le_bytes(r.bytes4()?);
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let tensor_count = r.u64()?;
        let kv_offset = r.offset;
        let kv_count = r.u64()?;
        r.check("kv count", kv_count, limits.max_kv_count, kv_offset)?;
        let mut kv = IndexMap::new();
        for _ in 0..kv_count {
            let key = r.string()?;
            let value_type = r.u32()?;
            let value = r.value(value_type)?;
            if kv.contains_key(&key) {
                return Err(GgufError::DuplicateKey(key));
            }
            kv.insert(key, value);
        }
        Ok(Self {
            version,
            tensor_count,
            kv,
        })
    }

    /// The GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The number of tensors the file declares (their infos are not read).
    pub fn tensor_count(&self) -> u64 {
        self.tensor_count
    }

    /// The value for `key`.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.kv.get(key)
    }

    /// All keys and values, in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &GgufValue)> {
        self.kv.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The string value for `key`.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(GgufValue::as_str)
    }

    /// The non-negative integer value for `key`.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(GgufValue::as_u64)
    }

    /// The string-array value for `key`.
    pub fn get_strings(&self, key: &str) -> Option<&[String]> {
        match self.get(key) {
            Some(GgufValue::Array(GgufArray::String(v))) => Some(v),
            _ => None,
        }
    }

    /// The integer-array value for `key`, as `i64`s (unsigned values above `i64::MAX` are `None`).
    pub fn get_ints(&self, key: &str) -> Option<Vec<i64>> {
        match self.get(key) {
            Some(GgufValue::Array(GgufArray::Int(v))) => Some(v.clone()),
            Some(GgufValue::Array(GgufArray::Uint(v))) => {
                v.iter().map(|&x| i64::try_from(x).ok()).collect()
            }
            _ => None,
        }
    }
}

struct Reader<R> {
    inner: R,
    offset: u64,
    limits: GgufLimits,
}

const PREALLOC_MAX: usize = 4096;

impl<R: Read> Reader<R> {
    fn check(
        &self,
        what: &'static str,
        value: u64,
        limit: u64,
        offset: u64,
    ) -> Result<(), GgufError> {
        if value > limit {
            Err(GgufError::OverLimit {
                what,
                value,
                limit,
                offset,
            })
        } else {
            Ok(())
        }
    }

    fn fill(&mut self, buf: &mut [u8]) -> Result<(), GgufError> {
        let len = buf.len() as u64;
        let end = self.offset.saturating_add(len);
        if end > self.limits.max_header_bytes {
            return Err(GgufError::OverLimit {
                what: "header size",
                value: end,
                limit: self.limits.max_header_bytes,
                offset: self.offset,
            });
        }
        match self.inner.read_exact(buf) {
            Ok(()) => {
                self.offset = end;
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(GgufError::Truncated {
                offset: self.offset,
            }),
            Err(e) => Err(GgufError::Io(e)),
        }
    }

    fn bytes4(&mut self) -> Result<[u8; 4], GgufError> {
        let mut b = [0u8; 4];
        self.fill(&mut b)?;
        Ok(b)
    }

    fn bytes8(&mut self) -> Result<[u8; 8], GgufError> {
        let mut b = [0u8; 8];
        self.fill(&mut b)?;
        Ok(b)
    }

    fn u8(&mut self) -> Result<u8, GgufError> {
        let mut b = [0u8; 1];
        self.fill(&mut b)?;
        Ok(b[0])
    }

    fn u16(&mut self) -> Result<u16, GgufError> {
        let mut b = [0u8; 2];
        self.fill(&mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.bytes4()?))
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.bytes8()?))
    }

    fn string(&mut self) -> Result<String, GgufError> {
        let start = self.offset;
        let len = self.u64()?;
        self.check("string length", len, self.limits.max_string_bytes, start)?;
        let remaining = self.limits.max_header_bytes.saturating_sub(self.offset);
        self.check("string length", len, remaining, start)?;
        let len = usize::try_from(len).map_err(|_| GgufError::OverLimit {
            what: "string length",
            value: len,
            limit: usize::MAX as u64,
            offset: start,
        })?;
        // grow as bytes actually arrive: a lying length cannot make us allocate
        let mut buf = Vec::with_capacity(len.min(PREALLOC_MAX));
        let mut chunk = [0u8; 4096];
        let mut left = len;
        while left > 0 {
            let n = left.min(chunk.len());
            self.fill(&mut chunk[..n])?;
            buf.extend_from_slice(&chunk[..n]);
            left -= n;
        }
        String::from_utf8(buf).map_err(|_| GgufError::InvalidUtf8 { offset: start })
    }

    fn value(&mut self, value_type: u32) -> Result<GgufValue, GgufError> {
        let offset = self.offset;
        Ok(match value_type {
            0 => GgufValue::Uint(u64::from(self.u8()?)),
            1 => GgufValue::Int(i64::from(self.u8()? as i8)),
            2 => GgufValue::Uint(u64::from(self.u16()?)),
            3 => GgufValue::Int(i64::from(self.u16()? as i16)),
            4 => GgufValue::Uint(u64::from(self.u32()?)),
            5 => GgufValue::Int(i64::from(self.u32()? as i32)),
            6 => GgufValue::Float(f64::from(f32::from_bits(self.u32()?))),
            7 => GgufValue::Bool(self.u8()? != 0),
            8 => GgufValue::String(self.string()?),
            9 => GgufValue::Array(self.array(0)?),
            10 => GgufValue::Uint(self.u64()?),
            11 => GgufValue::Int(self.u64()? as i64),
            12 => GgufValue::Float(f64::from_bits(self.u64()?)),
            _ => return Err(GgufError::UnknownType { value_type, offset }),
        })
    }

    fn array(&mut self, depth: u32) -> Result<GgufArray, GgufError> {
        let start = self.offset;
        if depth >= self.limits.max_array_depth {
            return Err(GgufError::OverLimit {
                what: "array depth",
                value: u64::from(depth) + 1,
                limit: u64::from(self.limits.max_array_depth),
                offset: start,
            });
        }
        let elem_type = self.u32()?;
        let len_offset = self.offset;
        let len = self.u64()?;
        self.check("array length", len, self.limits.max_array_len, len_offset)?;
        let cap = usize::try_from(len).unwrap_or(usize::MAX).min(PREALLOC_MAX);
        macro_rules! collect {
            ($variant:ident, $read:expr) => {{
                let mut v = Vec::with_capacity(cap);
                for _ in 0..len {
                    v.push($read);
                }
                GgufArray::$variant(v)
            }};
        }
        Ok(match elem_type {
            0 => collect!(Uint, u64::from(self.u8()?)),
            1 => collect!(Int, i64::from(self.u8()? as i8)),
            2 => collect!(Uint, u64::from(self.u16()?)),
            3 => collect!(Int, i64::from(self.u16()? as i16)),
            4 => collect!(Uint, u64::from(self.u32()?)),
            5 => collect!(Int, i64::from(self.u32()? as i32)),
            6 => collect!(Float, f64::from(f32::from_bits(self.u32()?))),
            7 => collect!(Bool, self.u8()? != 0),
            8 => collect!(String, self.string()?),
            9 => collect!(Array, self.array(depth + 1)?),
            10 => collect!(Uint, self.u64()?),
            11 => collect!(Int, self.u64()? as i64),
            12 => collect!(Float, f64::from_bits(self.u64()?)),
            _ => {
                return Err(GgufError::UnknownType {
                    value_type: elem_type,
                    offset: start,
                })
            }
        })
    }
}

/// A GGUF file whose SHA-256 is not the configured one, or that cannot be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DigestError {
    /// The file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file has other bytes: not the model's weights.
    #[error("{} has SHA-256 {got}, not the configured gguf_sha256 {want}: not the model's weights", path.display())]
    Mismatch {
        /// The file.
        path: std::path::PathBuf,
        /// Its SHA-256, lowercase hex.
        got: String,
        /// The SHA-256 asked for, as given.
        want: String,
    },
}

/// Refuses a GGUF whose SHA-256 is not `want` (hex, either case, surrounding space ignored):
/// the model's identity (design brief §10). Reads the whole file.
///
/// # Errors
///
/// [`DigestError`]: unreadable, or other bytes.
pub fn check_sha256(path: &Path, want: &str) -> Result<(), DigestError> {
    use sha2::Digest as _;
    let io = |source| DigestError::Io {
        path: path.to_owned(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut hasher = sha2::Sha256::new();
    std::io::copy(&mut file, &mut hasher).map_err(io)?;
    let got = hex::encode(hasher.finalize());
    if got.eq_ignore_ascii_case(want.trim()) {
        Ok(())
    } else {
        Err(DigestError::Mismatch {
            path: path.to_owned(),
            got,
            want: want.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn a_gguf_is_refused_unless_its_sha256_is_the_configured_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, b"abc").unwrap();
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert!(check_sha256(&path, &format!(" {} ", abc.to_uppercase())).is_ok());
        let err = check_sha256(&path, "00").unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "{} has SHA-256 {abc}, not the configured gguf_sha256 00: not the model's weights",
                path.display()
            )
        );
        let missing = check_sha256(&dir.path().join("none.gguf"), abc);
        assert!(matches!(missing, Err(DigestError::Io { .. })));
    }

    fn s(out: &mut Vec<u8>, v: &str) {
        out.extend_from_slice(&(v.len() as u64).to_le_bytes());
        out.extend_from_slice(v.as_bytes());
    }

    fn sample() -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&7u64.to_le_bytes()); // tensors
        b.extend_from_slice(&4u64.to_le_bytes()); // kvs
        s(&mut b, "tokenizer.ggml.pre");
        b.extend_from_slice(&8u32.to_le_bytes());
        s(&mut b, "smollm");
        s(&mut b, "llama.context_length");
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&8192u32.to_le_bytes());
        s(&mut b, "tokenizer.ggml.tokens");
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        s(&mut b, "a");
        s(&mut b, "<|im_end|>");
        s(&mut b, "tokenizer.ggml.token_type");
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&5u32.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&1i32.to_le_bytes());
        b.extend_from_slice(&3i32.to_le_bytes());
        b.extend_from_slice(b"tensor data follows and is never read");
        b
    }

    #[test]
    fn reads_a_synthetic_header() {
        let m = GgufMetadata::parse(&sample()).unwrap();
        assert_eq!(m.version(), 3);
        assert_eq!(m.tensor_count(), 7);
        assert_eq!(m.get_str("tokenizer.ggml.pre"), Some("smollm"));
        assert_eq!(m.get_u64("llama.context_length"), Some(8192));
        assert_eq!(
            m.get_strings("tokenizer.ggml.tokens").unwrap(),
            ["a".to_string(), "<|im_end|>".to_string()]
        );
        assert_eq!(m.get_ints("tokenizer.ggml.token_type"), Some(vec![1, 3]));
    }

    #[test]
    fn every_truncation_is_a_clean_error() {
        let b = sample();
        let header_len = b.len() - b"tensor data follows and is never read".len();
        for i in 0..header_len {
            let err = GgufMetadata::parse(&b[..i]).unwrap_err();
            assert!(
                matches!(err, GgufError::Truncated { .. } | GgufError::BadMagic),
                "{i}: {err}"
            );
        }
    }

    #[test]
    fn lying_lengths_are_refused_before_allocation() {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&u64::MAX.to_le_bytes()); // key length
        let err = GgufMetadata::parse(&b).unwrap_err();
        assert!(matches!(
            err,
            GgufError::OverLimit {
                what: "string length",
                ..
            }
        ));
        assert_eq!(
            GgufMetadata::parse(b"GGUF\x01\0\0\0")
                .unwrap_err()
                .to_string(),
            "unsupported gguf version 1"
        );
        assert!(matches!(
            GgufMetadata::parse(b"GGML").unwrap_err(),
            GgufError::BadMagic
        ));
    }

    #[test]
    fn reads_the_real_model_header() {
        let path = crate::test_support::model_gguf();
        let m = GgufMetadata::open(&path).unwrap();
        assert_eq!(m.get_str("tokenizer.ggml.pre"), Some("smollm"));
        assert_eq!(
            m.get_strings("tokenizer.ggml.tokens").map(<[_]>::len),
            Some(49152)
        );
        assert!(m.get_str("tokenizer.chat_template").is_some());
        assert_eq!(m.get_u64("llama.context_length"), Some(8192));
    }

    proptest::proptest! {
        #[test]
        fn never_panics_on_mutated_headers(
            flips in proptest::collection::vec((0usize..400, proptest::num::u8::ANY), 1..6),
        ) {
            let mut b = sample();
            for (i, v) in flips {
                let n = b.len();
                b[i % n] = v;
            }
            let _ = GgufMetadata::read_from(&b[..], GgufLimits { max_array_len: 1 << 20, ..GgufLimits::default() });
        }
    }
}
