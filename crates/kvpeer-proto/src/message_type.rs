//! The `type` of a control message: the nine names vLLM's P2P tier sends (what errors and
//! counters name a message by, before or without decoding the rest of it).

use std::fmt;

/// The `type` of a control message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MessageType {
    /// `connect`: handshake request, sent by each side.
    Connect,
    /// `connect_ack`: handshake accepted, sent once the peer's memory is registered.
    ConnectAck,
    /// `disconnect`: graceful close.
    Disconnect,
    /// `lookup`: consumer asks which keys the producer holds.
    Lookup,
    /// `lookup_resp`: producer's per-key answer.
    LookupResp,
    /// `fetch`: consumer asks for blocks to be written at given indexes (empty = finished).
    Fetch,
    /// `transfer_done`: producer reports a round written (or failed).
    TransferDone,
    /// `abort_fetch`: consumer cancels a round.
    AbortFetch,
    /// `abort_ack`: producer confirms no write of the round can still land.
    AbortAck,
}

impl MessageType {
    /// All nine types, in protocol.py's order.
    pub const ALL: [MessageType; 9] = [
        MessageType::Connect,
        MessageType::ConnectAck,
        MessageType::Disconnect,
        MessageType::Fetch,
        MessageType::Lookup,
        MessageType::LookupResp,
        MessageType::TransferDone,
        MessageType::AbortFetch,
        MessageType::AbortAck,
    ];

    /// The `type` string on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            MessageType::Connect => "connect",
            MessageType::ConnectAck => "connect_ack",
            MessageType::Disconnect => "disconnect",
            MessageType::Lookup => "lookup",
            MessageType::LookupResp => "lookup_resp",
            MessageType::Fetch => "fetch",
            MessageType::TransferDone => "transfer_done",
            MessageType::AbortFetch => "abort_fetch",
            MessageType::AbortAck => "abort_ack",
        }
    }

    /// The type named by a wire `type` string, if it is one of the nine.
    pub fn from_wire(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_str() == name)
    }
}

impl fmt::Display for MessageType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
