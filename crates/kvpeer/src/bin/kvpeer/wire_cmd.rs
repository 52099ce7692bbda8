//! `kvpeer wire decode|encode`: inspect and craft control-channel payloads.
//!
//! Both read stdin to the end (bounded by the payload limit) and write one result to stdout;
//! errors about the input itself go to stderr with exit status 2.

use std::io::{Read, Write};

use clap::{Args, Subcommand};
use kvpeer_proto::json::{payload_from_json, payload_to_json};
use kvpeer_proto::{decode_with_limits, DecodeLimits, Outcome};
use serde_json::{json, Value as Json};

/// Exit status for a payload that is not a valid message (`decode`).
pub(crate) const EXIT_NOT_VALID: u8 = 1;
/// Exit status for unusable input: unreadable stdin, bad hex, bad JSON, invalid message.
pub(crate) const EXIT_BAD_INPUT: u8 = 2;

/// An error about the command's input, reported on stderr with exit status 2.
#[derive(Debug, thiserror::Error)]
pub(crate) enum InputError {
    /// stdin could not be read.
    #[error("cannot read stdin: {0}")]
    Read(#[from] std::io::Error),
    /// The input is larger than the payload limit allows.
    #[error("input exceeds {limit} bytes (see --max-payload)")]
    TooLarge {
        /// The limit in force.
        limit: usize,
    },
    /// `--hex` text that is not hex.
    #[error("input is not hex: {0}")]
    Hex(#[from] hex::FromHexError),
    /// `encode` input that is not JSON.
    #[error("input is not JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// `encode` input that is not a payload or not a valid message.
    #[error("{0}")]
    Message(#[from] kvpeer_proto::json::JsonError),
}

/// `kvpeer wire`: tools for the control channel's msgpack payloads.
#[derive(Debug, Subcommand)]
pub(crate) enum WireCommand {
    /// Decode one payload and print it as one JSON line.
    ///
    /// Prints {"kind":"valid","message":{...}} for a valid message, with bytes as
    /// {"$bin":"<hex>"}, fields in wire order and unknown fields kept; otherwise
    /// {"kind":"undecodable"|"ignored"|"protocol_error","error":"..."}.
    /// Exit status: 0 valid, 1 not a valid message, 2 unusable input.
    #[command(after_help = "\
Examples:
  kvpeer wire decode --hex 83a474797065ab61626f72745f6665746368ad6b765f726571756573745f6964a172a9726f756e645f73657104
  kvpeer wire decode < captured-payload.bin
  xxd -p payload.bin | kvpeer wire decode --hex")]
    Decode(DecodeArgs),
    /// Encode a message from its JSON form into msgpack bytes.
    ///
    /// Reads one JSON object on stdin: a message ({"type":"fetch",...}) or a line printed by
    /// `kvpeer wire decode`. Bytes are written {"$bin":"<hex>"}; fields are encoded in the
    /// order given. The result must decode as a valid message unless --allow-invalid.
    /// Exit status: 0 written, 2 invalid JSON or invalid message.
    #[command(after_help = "\
Examples:
  echo '{\"type\":\"abort_fetch\",\"kv_request_id\":\"r\",\"round_seq\":4}' | kvpeer wire encode --hex
  kvpeer wire decode --hex 81a474797065aa646973636f6e6e656374 | kvpeer wire encode > disconnect.bin")]
    Encode(EncodeArgs),
}

/// Arguments of `kvpeer wire decode`.
#[derive(Debug, Args)]
pub(crate) struct DecodeArgs {
    /// Read hex text instead of raw bytes: from the argument if given, else from stdin.
    /// Whitespace is ignored.
    #[arg(long, value_name = "HEX", num_args = 0..=1, default_missing_value = "")]
    hex: Option<String>,
    /// Largest payload accepted, in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = DecodeLimits::DEFAULT_MAX_PAYLOAD_BYTES)]
    max_payload: usize,
}

/// Arguments of `kvpeer wire encode`.
#[derive(Debug, Args)]
pub(crate) struct EncodeArgs {
    /// Write hex text (and a newline) instead of raw bytes.
    #[arg(long)]
    hex: bool,
    /// Encode even if the result is not a valid message (to craft bad input for tests).
    #[arg(long)]
    allow_invalid: bool,
}

/// Runs a wire subcommand; returns the process exit status.
pub(crate) fn run(cmd: WireCommand) -> u8 {
    let result = match cmd {
        WireCommand::Decode(args) => decode(&args),
        WireCommand::Encode(args) => encode(&args),
    };
    match result {
        Ok(status) => status,
        Err(e) => {
            eprintln!("error: {e}");
            EXIT_BAD_INPUT
        }
    }
}

/// Reads stdin to the end, refusing more than `limit` bytes.
fn read_stdin(limit: usize) -> Result<Vec<u8>, InputError> {
    let mut buf = Vec::new();
    std::io::stdin()
        .lock()
        .take(limit as u64 + 1)
        .read_to_end(&mut buf)?;
    if buf.len() > limit {
        return Err(InputError::TooLarge { limit });
    }
    Ok(buf)
}

fn parse_hex(text: &[u8]) -> Result<Vec<u8>, InputError> {
    let compact: Vec<u8> = text
        .iter()
        .copied()
        .filter(|b| !b.is_ascii_whitespace())
        .collect();
    Ok(hex::decode(compact)?)
}

/// The JSON line `decode` prints for a payload, and whether it is a valid message.
pub(crate) fn decode_report(payload: &[u8], limits: &DecodeLimits) -> (Json, Outcome) {
    match decode_with_limits(payload, limits) {
        Ok(_) => match payload_to_json(payload, limits) {
            Ok(message) => (json!({"kind": "valid", "message": message}), Outcome::Valid),
            // Unreachable in practice: the payload just decoded under the same limits.
            Err(e) => (
                json!({"kind": Outcome::Undecodable.as_str(), "error": e.to_string()}),
                Outcome::Undecodable,
            ),
        },
        Err(e) => {
            let detail = match &e {
                kvpeer_proto::DecodeError::Undecodable(inner) => inner.to_string(),
                kvpeer_proto::DecodeError::Ignored(inner) => inner.to_string(),
                kvpeer_proto::DecodeError::Protocol(inner) => inner.to_string(),
                other => other.to_string(),
            };
            (
                json!({"kind": e.outcome().as_str(), "error": detail}),
                e.outcome(),
            )
        }
    }
}

fn decode(args: &DecodeArgs) -> Result<u8, InputError> {
    let payload = match &args.hex {
        Some(text) if !text.is_empty() => parse_hex(text.as_bytes())?,
        // Hex text is two characters a byte, plus whitespace: allow for both.
        Some(_) => parse_hex(&read_stdin(args.max_payload.saturating_mul(3))?)?,
        None => read_stdin(args.max_payload)?,
    };
    let limits = DecodeLimits {
        max_payload_bytes: args.max_payload,
        ..DecodeLimits::default()
    };
    let (report, outcome) = decode_report(&payload, &limits);
    println!("{report}");
    Ok(if outcome == Outcome::Valid {
        0
    } else {
        EXIT_NOT_VALID
    })
}

/// The payload `encode` writes for a JSON document (a message or a `decode` line).
pub(crate) fn encode_payload(doc: &Json, allow_invalid: bool) -> Result<Vec<u8>, InputError> {
    let message = match doc.get("message") {
        Some(inner) if doc.get("type").is_none() && doc.get("kind").is_some() => inner,
        _ => doc,
    };
    let payload = payload_from_json(message)?;
    if !allow_invalid {
        decode_with_limits(&payload, &DecodeLimits::default())
            .map_err(kvpeer_proto::json::JsonError::from)?;
    }
    Ok(payload)
}

fn encode(args: &EncodeArgs) -> Result<u8, InputError> {
    // JSON text of a maximal payload is at most a few times its size.
    let input = read_stdin(DecodeLimits::DEFAULT_MAX_PAYLOAD_BYTES.saturating_mul(4))?;
    let doc: Json = serde_json::from_slice(&input)?;
    let payload = encode_payload(&doc, args.allow_invalid)?;
    let mut stdout = std::io::stdout().lock();
    if args.hex {
        writeln!(stdout, "{}", hex::encode(&payload))?;
    } else {
        stdout.write_all(&payload)?;
    }
    stdout.flush()?;
    Ok(0)
}
