//! ZMTP 3.1 as kvpeer speaks it, without libzmq: the codec ([`codec`], its items re-exported
//! here), one connection of any socket type as a state machine ([`connection`]), and the two
//! ways a socket of ours is reached: a listening socket with its accepted connections
//! (`listener.rs`, with `admission.rs` choosing who gets a slot when it is full) and a
//! connecting one (`dialer.rs`). The control channel and the KV event stream are built from
//! these and nothing else, so every bound against a hostile peer is written once.

pub(crate) mod admission;
pub mod codec;
pub mod connection;
pub(crate) mod dialer;
pub(crate) mod listener;

pub use codec::*;
