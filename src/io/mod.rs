//! File I/O around the library: safetensors import/export, memory mapping,
//! atomic writes. Codec and container code never touch the file system.

pub mod file;
pub mod safetensors;
