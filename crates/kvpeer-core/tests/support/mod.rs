//! The deterministic test driver and its fakes.
#![allow(dead_code, unreachable_pub)]

pub mod cluster;
pub mod fakes;
