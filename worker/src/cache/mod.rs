//! The cache volume's files: the chunk format (`chunk`) and the entries, markers, leases and
//! eviction around it (`store`). The engine's use of them is `crate::cached`.

pub mod chunk;
pub mod store;
