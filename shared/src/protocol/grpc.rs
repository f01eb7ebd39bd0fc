//! gRPC on the wire, as far as the gateway reads it: status codes, the 5-byte prefix
//! of each length-prefixed message (to count message bytes without buffering a
//! message), and gRPC-Web's trailers frame.
//!
//! The gateway never decodes a message: it proxies frames as they come and counts
//! payload bytes. A message's bytes are its payload, the prefix (1 flag byte, 4 length
//! bytes) excluded; that is what per-byte metering charges.

use crate::call::ErrorCode;
use bytes::{BufMut, Bytes, BytesMut};
use http::HeaderMap;

/// The gRPC status codes the gateway answers or records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Code {
    Ok = 0,
    Cancelled = 1,
    Unknown = 2,
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    NotFound = 5,
    PermissionDenied = 7,
    ResourceExhausted = 8,
    FailedPrecondition = 9,
    Unimplemented = 12,
    Internal = 13,
    Unavailable = 14,
    Unauthenticated = 16,
}

impl Code {
    pub fn number(self) -> u16 {
        self as u16
    }

    /// The status a gRPC caller reads for a gateway's code: the gRPC mapping of the
    /// refusal's HTTP status (gRPC's own HTTP mapping, read backwards), and the codes
    /// that are gRPC's own.
    pub fn of(code: ErrorCode) -> Code {
        match code {
            ErrorCode::InvalidApiKey => Code::Unauthenticated,
            ErrorCode::UnknownAgent
            | ErrorCode::UnknownTenant
            | ErrorCode::SensitiveNoInternalBackend
            | ErrorCode::ResidencyUnavailable => Code::PermissionDenied,
            ErrorCode::BudgetExceeded | ErrorCode::RateLimitExceeded | ErrorCode::MessageTooLarge => {
                Code::ResourceExhausted
            }
            ErrorCode::RunNotFound => Code::NotFound,
            ErrorCode::RunEnded => Code::FailedPrecondition,
            ErrorCode::InvalidRequest
            | ErrorCode::CapabilityUnavailable
            | ErrorCode::ImageOriginNotAllowed
            | ErrorCode::BodyTooLarge
            | ErrorCode::ImageTooLarge
            | ErrorCode::HeadersTooLarge => Code::InvalidArgument,
            ErrorCode::NotFound
            | ErrorCode::OperationNotFound
            | ErrorCode::MethodNotAllowed
            | ErrorCode::UnknownService => Code::Unimplemented,
            ErrorCode::UpstreamError
            | ErrorCode::UpstreamUnavailable
            | ErrorCode::Overloaded
            | ErrorCode::LedgerBusy => Code::Unavailable,
            ErrorCode::UpstreamTimeout | ErrorCode::Deadline => Code::DeadlineExceeded,
            ErrorCode::ClientClosedRequest | ErrorCode::Cancelled => Code::Cancelled,
            ErrorCode::RealtimeUnavailable | ErrorCode::InternalError => Code::Internal,
        }
    }
}

/// The status in a `grpc-status` header or trailer, if it is a number.
pub fn status_of(headers: &HeaderMap) -> Option<u16> {
    headers.get("grpc-status")?.to_str().ok()?.trim().parse().ok()
}

/// `grpc-message` is percent-encoded (gRPC over HTTP/2): every byte outside printable
/// ASCII, and `%` itself.
pub fn encode_message(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for byte in message.bytes() {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// Counts the messages of one direction of a call as its bytes pass, chunk by chunk,
/// whatever the chunks' boundaries: never holds more than a prefix (5 bytes).
#[derive(Debug, Clone, Default)]
pub struct MessageCounter {
    prefix: [u8; 5],
    prefix_len: usize,
    /// Payload bytes of the current message still to come.
    remaining: u64,
    /// Payload bytes seen so far.
    pub payload_bytes: u64,
    pub messages: u64,
}

/// What a chunk brings: the payload lengths its completed prefixes declare.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Seen {
    pub declared: Vec<u64>,
    /// Payload bytes of this chunk.
    pub payload: u64,
}

impl MessageCounter {
    /// Reads one chunk.
    pub fn feed(&mut self, mut chunk: &[u8]) -> Seen {
        let mut seen = Seen::default();
        while !chunk.is_empty() {
            if self.remaining > 0 {
                let take = usize::try_from(self.remaining).unwrap_or(usize::MAX).min(chunk.len());
                self.remaining -= take as u64;
                seen.payload += take as u64;
                chunk = &chunk[take..];
                continue;
            }
            let take = (5 - self.prefix_len).min(chunk.len());
            self.prefix[self.prefix_len..self.prefix_len + take].copy_from_slice(&chunk[..take]);
            self.prefix_len += take;
            chunk = &chunk[take..];
            if self.prefix_len == 5 {
                self.prefix_len = 0;
                let length = u32::from_be_bytes([self.prefix[1], self.prefix[2], self.prefix[3], self.prefix[4]]);
                self.remaining = u64::from(length);
                self.messages += 1;
                seen.declared.push(u64::from(length));
            }
        }
        self.payload_bytes += seen.payload;
        seen
    }

    /// Whether the bytes so far end on a message boundary.
    pub fn at_boundary(&self) -> bool {
        self.remaining == 0 && self.prefix_len == 0
    }
}

/// gRPC-Web carries the trailers in the body: a frame flagged 0x80 holding them as
/// HTTP/1 header lines.
pub fn web_trailers_frame(trailers: &HeaderMap) -> Bytes {
    let mut block = Vec::new();
    for (name, value) in trailers {
        block.extend_from_slice(name.as_str().as_bytes());
        block.extend_from_slice(b":");
        block.extend_from_slice(value.as_bytes());
        block.extend_from_slice(b"\r\n");
    }
    let mut frame = BytesMut::with_capacity(5 + block.len());
    frame.put_u8(0x80);
    frame.put_u32(u32::try_from(block.len()).unwrap_or(u32::MAX));
    frame.extend_from_slice(&block);
    frame.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(payload: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn counts_payload_bytes_across_any_chunking() {
        let mut wire = message(b"hello");
        wire.extend(message(b""));
        wire.extend(message(&[7; 300]));
        for size in [1, 2, 3, 5, 7, 64, wire.len()] {
            let mut counter = MessageCounter::default();
            let mut declared = Vec::new();
            for chunk in wire.chunks(size) {
                declared.extend(counter.feed(chunk).declared);
            }
            assert_eq!(declared, vec![5, 0, 300], "chunks of {size}");
            assert_eq!((counter.payload_bytes, counter.messages), (305, 3), "chunks of {size}");
            assert!(counter.at_boundary());
        }
    }

    #[test]
    fn a_cut_message_is_not_at_a_boundary() {
        let mut counter = MessageCounter::default();
        let wire = message(b"hello");
        counter.feed(&wire[..7]);
        assert_eq!(counter.payload_bytes, 2);
        assert!(!counter.at_boundary());
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(encode_message("budget_exceeded: 100% spent"), "budget_exceeded: 100%25 spent");
        assert_eq!(encode_message("é"), "%C3%A9");
    }

    #[test]
    fn web_trailers_are_a_flagged_frame() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        let frame = web_trailers_frame(&trailers);
        assert_eq!(&frame[..5], &[0x80, 0, 0, 0, 15]);
        assert_eq!(&frame[5..], b"grpc-status:0\r\n");
    }
}
