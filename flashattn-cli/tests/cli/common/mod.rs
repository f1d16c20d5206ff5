//! Helpers shared by the CLI's end-to-end tests: running the binary, and writing safetensors
//! files by hand.

#![allow(dead_code)] // each module of the test binary uses its own part

use std::path::Path;
use std::process::{Command, Output};

pub const BIN: &str = env!("CARGO_BIN_EXE_flashattn");

/// Runs the binary under test: cargo's build, or `FLASHATTN_BIN` (bench/gpu/run.sh points it at
/// the binary carried to a GPU machine, which has no toolchain).
pub fn flashattn(args: &[&str]) -> Output {
    let bin = std::env::var("FLASHATTN_BIN").unwrap_or_else(|_| BIN.into());
    Command::new(bin).args(args).output().unwrap()
}

/// Asserts that a run succeeded, showing its stderr if not.
pub fn assert_ok(res: &Output) {
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
}

/// A tensor to write: name, safetensors dtype name, shape, little-endian bytes.
#[derive(Clone)]
pub struct Raw {
    pub name: String,
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

pub fn raw(name: &str, dtype: &'static str, shape: &[usize], bytes: Vec<u8>) -> Raw {
    Raw {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        bytes,
    }
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn f32_raw(name: &str, shape: &[usize], v: &[f32]) -> Raw {
    raw(name, "F32", shape, f32_bytes(v))
}

pub fn i32_raw(name: &str, shape: &[usize], v: &[i32]) -> Raw {
    raw(name, "I32", shape, i32_bytes(v))
}

/// Writes a safetensors file by hand. The header is padded to an odd length on purpose, so every
/// tensor's data starts at an address no f32 or f16 load may assume aligned: the CLI must copy
/// bytes, not reinterpret them.
pub fn write_st(path: &Path, tensors: &[Raw]) {
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for t in tensors {
        let end = offset + t.bytes.len();
        header.insert(
            t.name.clone(),
            serde_json::json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut json = serde_json::Value::Object(header).to_string();
    while json.len() % 4 != 1 {
        json.push(' ');
    }
    let mut file = (json.len() as u64).to_le_bytes().to_vec();
    file.extend(json.as_bytes());
    for t in tensors {
        file.extend(&t.bytes);
    }
    std::fs::write(path, file).unwrap();
}

/// `tensors` with `t` in place of the one of the same name.
pub fn replace(mut tensors: Vec<Raw>, t: Raw) -> Vec<Raw> {
    tensors.retain(|x| x.name != t.name);
    tensors.push(t);
    tensors
}

/// `tensors` without the one named `name`.
pub fn without(mut tensors: Vec<Raw>, name: &str) -> Vec<Raw> {
    tensors.retain(|x| x.name != name);
    tensors
}
