//! The deterministic test driver, the scripted mock peer, and their fakes.
#![allow(dead_code, unreachable_pub)]

pub mod cluster;
pub mod fakes;
pub mod mock;
