//! Lets every gRPC client call the Unix socket, not only grpc-go.
//!
//! grpc-core clients (Python's grpcio, C++, Ruby, PHP, …) send the socket path,
//! percent-encoded, as the HTTP/2 `:authority` of a `unix:` target
//! (`run%2Fcube-csi-bridge%2Fnfs.sock`), and grpc-java sends the raw path. h2, under hyper
//! and tonic, parses `:authority` as a URI authority and resets such a stream with
//! PROTOCOL_ERROR before the service sees the request (h2 0.4 `server.rs`,
//! `convert_poll_message`: "malformed headers: malformed authority"). grpc-go sends
//! `localhost` and is unaffected.
//!
//! [`AuthorityFix`] wraps an accepted connection and watches what the client sends. It
//! keeps a mirror of the client's HPACK decoding state, checks each request's
//! `:authority` exactly as h2 will (`http::uri::Authority`), and rewrites one h2 would
//! refuse to `localhost`, what grpc-go sends. Everything else passes unchanged: frames
//! other than HEADERS/CONTINUATION are streamed through as they arrive, and a header
//! block is forwarded byte for byte while the connection has needed no rewrite. From the
//! first rewrite on, every header block of that connection is re-encoded with literals
//! that touch no HPACK table, so h2's table can never disagree with the client's.
//! Anything the filter does not understand (no HTTP/2 preface, a malformed frame or
//! header block) or will not hold (a header list larger than h2 accepts) makes it step
//! aside for the rest of the connection, so h2 sees and answers exactly what the client
//! sent. The write side is never touched.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_stream::Stream;
use tonic::transport::server::Connected;

/// The client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER_LEN: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// Frames the filter writes stay within SETTINGS_MAX_FRAME_SIZE's initial value, which
/// every HTTP/2 server accepts whatever it advertised.
const MAX_WRITTEN_FRAME: usize = 16_384;
/// A header block larger than this is handed to h2 untouched (h2 applies its own limits).
const MAX_HEADER_BLOCK: usize = 1 << 20;
/// A block whose decoded header list (RFC 7541 §4.1: name + value + 32 per field) passes
/// this is not collected but handed to h2 untouched, which refuses anything over its
/// SETTINGS_MAX_HEADER_LIST_SIZE (16 KiB under hyper). Indexed references to one large
/// table entry make a block of 1 MiB decode to gigabytes.
const MAX_HEADER_LIST: usize = 64 * 1024;
/// What replaces an authority h2 would refuse: what grpc-go sends for a Unix socket.
const REPLACEMENT_AUTHORITY: &[u8] = b"localhost";
const READ_CHUNK: usize = 8 * 1024;

/// A server-side connection whose client's unusable `:authority` values are rewritten
/// before the HTTP/2 server parses them (module docs).
#[derive(Debug)]
pub struct AuthorityFix<IO> {
    io: IO,
    /// Bytes read from the client that the filter has not consumed yet.
    received: BytesMut,
    /// Bytes the filter has passed on, waiting for the server to read them.
    ready: BytesMut,
    filter: Filter,
}

impl<IO> AuthorityFix<IO> {
    pub fn new(io: IO) -> Self {
        AuthorityFix {
            io,
            received: BytesMut::new(),
            ready: BytesMut::new(),
            filter: Filter::new(),
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for AuthorityFix<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.ready.is_empty() {
                let n = buf.remaining().min(this.ready.len());
                buf.put_slice(&this.ready[..n]);
                this.ready.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.filter.stepped_aside() && this.received.is_empty() {
                return Pin::new(&mut this.io).poll_read(cx, buf);
            }
            this.received.reserve(READ_CHUNK);
            let n = ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut this.io),
                cx,
                &mut this.received
            ))?;
            if n == 0 {
                // End of stream: whatever is held back goes to the server as it came.
                this.filter.end(&mut this.received, &mut this.ready);
                if this.ready.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            this.filter.process(&mut this.received, &mut this.ready);
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl<IO: Connected> Connected for AuthorityFix<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// Wraps every connection of an incoming stream (the hook into the server).
pub fn fix_incoming<S, IO>(incoming: S) -> impl Stream<Item = io::Result<AuthorityFix<IO>>>
where
    S: Stream<Item = io::Result<IO>>,
{
    tokio_stream::StreamExt::map(incoming, |conn| conn.map(AuthorityFix::new))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Checking the client preface; `usize` bytes of it matched so far.
    Preface(usize),
    Frames,
    /// Not HTTP/2 as the filter understands it: every byte passes untouched.
    SteppedAside,
}

/// What a rewritten block keeps from its HEADERS frame.
#[derive(Debug, Clone, Copy)]
struct BlockHead {
    stream_id: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
}

/// A header block split over a HEADERS frame and CONTINUATIONs, being collected.
#[derive(Debug)]
struct OpenBlock {
    head: BlockHead,
    /// The frames as received, to forward unchanged.
    raw: Vec<u8>,
    /// The HPACK fragments, concatenated.
    fragment: Vec<u8>,
}

/// The connection's read-side state machine, free of I/O so it is tested on byte strings.
struct Filter {
    stage: Stage,
    /// Payload bytes of a pass-through frame still to forward.
    passing: usize,
    block: Option<OpenBlock>,
    /// A mirror of h2's HPACK decoder: it sees every header block the client sent.
    decoder: loona_hpack::Decoder<'static>,
    /// Once a block was rewritten, h2's table no longer matches the client's: every
    /// later block is re-encoded.
    rewriting: bool,
    /// Header blocks re-encoded so far (the tests check it).
    rewritten_blocks: u64,
    /// Scratch space for one decoded header list, reused across blocks.
    names_values: Vec<u8>,
    /// Per field: (start in `names_values`, name length, value length).
    fields: Vec<(usize, usize, usize)>,
}

impl std::fmt::Debug for Filter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Filter")
            .field("stage", &self.stage)
            .field("rewriting", &self.rewriting)
            .field("rewritten_blocks", &self.rewritten_blocks)
            .finish_non_exhaustive()
    }
}

impl Filter {
    fn new() -> Self {
        Filter {
            stage: Stage::Preface(0),
            passing: 0,
            block: None,
            decoder: mirror_decoder(),
            rewriting: false,
            rewritten_blocks: 0,
            names_values: Vec::new(),
            fields: Vec::new(),
        }
    }

    fn stepped_aside(&self) -> bool {
        self.stage == Stage::SteppedAside
    }

    /// Moves what can be decided from `input` to `output`; keeps an incomplete frame.
    fn process(&mut self, input: &mut BytesMut, output: &mut BytesMut) {
        loop {
            match self.stage {
                Stage::SteppedAside => {
                    output.extend_from_slice(&input.split());
                    return;
                }
                Stage::Preface(matched) => {
                    let n = (PREFACE.len() - matched).min(input.len());
                    if input[..n] != PREFACE[matched..matched + n] {
                        self.step_aside(input, output);
                        continue;
                    }
                    output.extend_from_slice(&input.split_to(n));
                    if matched + n < PREFACE.len() {
                        self.stage = Stage::Preface(matched + n);
                        return;
                    }
                    self.stage = Stage::Frames;
                }
                Stage::Frames => {
                    if self.passing > 0 {
                        let n = self.passing.min(input.len());
                        output.extend_from_slice(&input.split_to(n));
                        self.passing -= n;
                        if self.passing > 0 {
                            return;
                        }
                    }
                    if input.len() < FRAME_HEADER_LEN {
                        return;
                    }
                    let length = usize::from(input[0]) << 16
                        | usize::from(input[1]) << 8
                        | usize::from(input[2]);
                    let kind = input[3];
                    let in_block = self.block.is_some();
                    if kind != TYPE_HEADERS && kind != TYPE_CONTINUATION {
                        if in_block {
                            // Only CONTINUATION may follow an unfinished block.
                            self.step_aside(input, output);
                            continue;
                        }
                        output.extend_from_slice(&input.split_to(FRAME_HEADER_LEN));
                        self.passing = length;
                        continue;
                    }
                    let collected = self.block.as_ref().map_or(0, |b| b.raw.len());
                    if collected + length > MAX_HEADER_BLOCK {
                        self.step_aside(input, output);
                        continue;
                    }
                    if input.len() < FRAME_HEADER_LEN + length {
                        input.reserve(FRAME_HEADER_LEN + length - input.len());
                        return;
                    }
                    let frame = input.split_to(FRAME_HEADER_LEN + length);
                    if !self.header_frame(&frame, output) {
                        // Hand over the frame and everything after it as received.
                        let rest = input.split();
                        input.extend_from_slice(&frame);
                        input.extend_from_slice(&rest);
                        self.step_aside(input, output);
                    }
                }
            }
        }
    }

    /// At end of stream: passes on whatever is held back, as received.
    fn end(&mut self, input: &mut BytesMut, output: &mut BytesMut) {
        self.step_aside(input, output);
    }

    /// From now on every byte passes untouched; held-back bytes go first, in order.
    fn step_aside(&mut self, input: &mut BytesMut, output: &mut BytesMut) {
        if let Some(block) = self.block.take() {
            output.extend_from_slice(&block.raw);
        }
        output.extend_from_slice(&input.split());
        self.stage = Stage::SteppedAside;
    }

    /// Takes one HEADERS or CONTINUATION frame; false if it is not one the filter can
    /// handle and did not take (left to h2, which will refuse it as it would have).
    fn header_frame(&mut self, frame: &[u8], output: &mut BytesMut) -> bool {
        let kind = frame[3];
        let flags = frame[4];
        let stream_id = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
        let payload = &frame[FRAME_HEADER_LEN..];
        let end_headers = flags & FLAG_END_HEADERS != 0;
        if kind == TYPE_HEADERS {
            if self.block.is_some() {
                return false;
            }
            let Some((fragment, priority)) = headers_fragment(flags, payload) else {
                return false;
            };
            let head = BlockHead {
                stream_id,
                end_stream: flags & FLAG_END_STREAM != 0,
                priority,
            };
            if end_headers {
                // The usual case: the whole block in one frame, used where it lies.
                self.finish_block(head, fragment, frame, output);
            } else {
                self.block = Some(OpenBlock {
                    head,
                    raw: frame.to_vec(),
                    fragment: fragment.to_vec(),
                });
            }
            return true;
        }
        let Some(block) = self.block.as_mut() else {
            return false;
        };
        if block.head.stream_id != stream_id {
            return false;
        }
        block.raw.extend_from_slice(frame);
        block.fragment.extend_from_slice(payload);
        if end_headers {
            let block = self.block.take().expect("a block is open");
            self.finish_block(block.head, &block.fragment, &block.raw, output);
        }
        true
    }

    /// Passes on a complete header block: `raw` as received, or re-encoded.
    fn finish_block(
        &mut self,
        head: BlockHead,
        fragment: &[u8],
        raw: &[u8],
        output: &mut BytesMut,
    ) {
        if !self.decode(fragment) {
            // Leave the block and the rest to h2, which will fail it as it would have
            // (its own header list limit is far below MAX_HEADER_LIST).
            output.extend_from_slice(raw);
            self.stage = Stage::SteppedAside;
            return;
        }
        let refused = self.fields().any(|(name, value)| {
            name == b":authority" && http::uri::Authority::try_from(value).is_err()
        });
        if refused && !self.rewriting {
            self.rewriting = true;
            tracing::debug!(
                stream_id = head.stream_id,
                "rewriting an HTTP/2 :authority h2 would refuse (a socket path) to localhost on this connection"
            );
        }
        if self.rewriting {
            self.write_rewritten(head, output);
            self.rewritten_blocks += 1;
        } else {
            output.extend_from_slice(raw);
        }
    }

    /// Decodes a block into the scratch list, updating the mirror table; false if the
    /// block is malformed or its header list passes `MAX_HEADER_LIST`.
    fn decode(&mut self, fragment: &[u8]) -> bool {
        self.names_values.clear();
        self.fields.clear();
        let (names_values, fields) = (&mut self.names_values, &mut self.fields);
        let mut list_size = 0usize;
        let decoded = self
            .decoder
            .decode_with_cb(fragment, |name, value| {
                // The decoder cannot be stopped; past the bound it only walks the rest
                // (indexed fields are borrowed from its table, nothing is allocated).
                list_size = list_size.saturating_add(name.len() + value.len() + 32);
                if list_size > MAX_HEADER_LIST {
                    return;
                }
                let start = names_values.len();
                names_values.extend_from_slice(&name);
                names_values.extend_from_slice(&value);
                fields.push((start, name.len(), value.len()));
            })
            .is_ok();
        decoded && list_size <= MAX_HEADER_LIST
    }

    fn fields(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.fields.iter().map(|&(start, name_len, value_len)| {
            let name = &self.names_values[start..start + name_len];
            let value = &self.names_values[start + name_len..start + name_len + value_len];
            (name, value)
        })
    }

    /// Re-encodes the decoded block as literals without indexing (no table is touched),
    /// with a refused `:authority` replaced, framed as HEADERS + CONTINUATIONs.
    fn write_rewritten(&self, head: BlockHead, output: &mut BytesMut) {
        let mut encoded = Vec::with_capacity(self.names_values.len() + 4 * self.fields.len());
        for (name, value) in self.fields() {
            let value = if name == b":authority" && http::uri::Authority::try_from(value).is_err() {
                REPLACEMENT_AUTHORITY
            } else {
                value
            };
            // Literal Header Field without Indexing, New Name (RFC 7541 §6.2.2).
            encoded.push(0x00);
            encode_string(name, &mut encoded);
            encode_string(value, &mut encoded);
        }
        let mut flags = 0;
        if head.end_stream {
            flags |= FLAG_END_STREAM;
        }
        let mut first = Vec::new();
        if let Some(priority) = head.priority {
            flags |= FLAG_PRIORITY;
            first.extend_from_slice(&priority);
        }
        let room = MAX_WRITTEN_FRAME - first.len();
        let (leading, mut rest) = encoded.split_at(room.min(encoded.len()));
        first.extend_from_slice(leading);
        if rest.is_empty() {
            flags |= FLAG_END_HEADERS;
        }
        write_frame(output, TYPE_HEADERS, flags, head.stream_id, &first);
        while !rest.is_empty() {
            let (chunk, more) = rest.split_at(MAX_WRITTEN_FRAME.min(rest.len()));
            let flags = if more.is_empty() { FLAG_END_HEADERS } else { 0 };
            write_frame(output, TYPE_CONTINUATION, flags, head.stream_id, chunk);
            rest = more;
        }
    }
}

/// An HPACK decoder that accepts what h2's decoder accepts: a dynamic table of at most
/// SETTINGS_HEADER_TABLE_SIZE's initial 4096 bytes (tonic leaves hyper's h2 at that).
fn mirror_decoder() -> loona_hpack::Decoder<'static> {
    let mut decoder = loona_hpack::Decoder::new();
    decoder.set_max_allowed_table_size(4096);
    decoder
}

/// The header block fragment of a HEADERS payload (padding and priority removed), and
/// the priority fields if present; `None` if the payload is malformed.
fn headers_fragment(flags: u8, payload: &[u8]) -> Option<(&[u8], Option<[u8; 5]>)> {
    let mut body = payload;
    let mut padding = 0;
    if flags & FLAG_PADDED != 0 {
        let (&pad, tail) = body.split_first()?;
        padding = usize::from(pad);
        body = tail;
    }
    let mut priority = None;
    if flags & FLAG_PRIORITY != 0 {
        let fields: [u8; 5] = body.get(..5)?.try_into().ok()?;
        priority = Some(fields);
        body = &body[5..];
    }
    let end = body.len().checked_sub(padding)?;
    Some((&body[..end], priority))
}

/// An HPACK string literal, not Huffman-coded (RFC 7541 §5.2).
fn encode_string(bytes: &[u8], out: &mut Vec<u8>) {
    encode_integer(bytes.len(), 7, 0x00, out);
    out.extend_from_slice(bytes);
}

/// An HPACK integer with an N-bit prefix (RFC 7541 §5.1); `high` holds the bits above it.
fn encode_integer(mut value: usize, prefix_bits: u8, high: u8, out: &mut Vec<u8>) {
    let max_prefix = (1usize << prefix_bits) - 1;
    if value < max_prefix {
        out.push(high | value as u8);
        return;
    }
    out.push(high | max_prefix as u8);
    value -= max_prefix;
    while value >= 0x80 {
        out.push((value & 0x7f) as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn write_frame(output: &mut BytesMut, kind: u8, flags: u8, stream_id: u32, payload: &[u8]) {
    let length = payload.len() as u32;
    output.reserve(FRAME_HEADER_LEN + payload.len());
    output.put_slice(&length.to_be_bytes()[1..]);
    output.put_u8(kind);
    output.put_u8(flags);
    output.put_u32(stream_id);
    output.put_slice(payload);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request header block as grpcio 1.85 (grpc-core) encodes it for
    /// `unix:///tmp/repro/sniff.sock`, captured on the wire: literal names with
    /// incremental indexing, `:authority` = `tmp%2Frepro%2Fsniff.sock`.
    const GRPC_CORE_BLOCK: &str = "40053a70617468062f782e592f5a400a3a617574686f7269747918746d70253246726570726f253246736e6966662e736f636b8386400c636f6e74656e742d74797065106170706c69636174696f6e2f677270634002746508747261696c6572734014677270632d6163636570742d656e636f64696e67176964656e746974792c206465666c6174652c20677a6970400c677270632d74696d656f757405323933306d400a757365722d6167656e7430677270632d707974686f6e2f312e38352e3320677270632d632f35382e302e3020286c696e75783b2063687474703229";

    fn hex(text: &str) -> Vec<u8> {
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
            .collect()
    }

    fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        write_frame(&mut out, kind, flags, stream_id, payload);
        out.to_vec()
    }

    fn settings() -> Vec<u8> {
        frame(0x4, 0, 0, &[])
    }

    fn data(stream_id: u32, payload: &[u8]) -> Vec<u8> {
        frame(0x0, FLAG_END_STREAM, stream_id, payload)
    }

    fn headers(stream_id: u32, block: &[u8]) -> Vec<u8> {
        frame(TYPE_HEADERS, FLAG_END_HEADERS, stream_id, block)
    }

    fn connection(frames: &[Vec<u8>]) -> Vec<u8> {
        let mut bytes = PREFACE.to_vec();
        for f in frames {
            bytes.extend_from_slice(f);
        }
        bytes
    }

    /// Runs the filter over `input` delivered in chunks of `chunk` bytes, then end of stream.
    fn run(input: &[u8], chunk: usize) -> (Vec<u8>, Filter) {
        let mut filter = Filter::new();
        let (mut pending, mut out) = (BytesMut::new(), BytesMut::new());
        for piece in input.chunks(chunk.max(1)) {
            pending.extend_from_slice(piece);
            filter.process(&mut pending, &mut out);
        }
        filter.end(&mut pending, &mut out);
        (out.to_vec(), filter)
    }

    /// Parsed frames: (type, flags, stream id, payload).
    fn frames_of(bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        assert!(bytes.starts_with(PREFACE), "the preface goes first");
        let mut rest = &bytes[PREFACE.len()..];
        let mut frames = Vec::new();
        while !rest.is_empty() {
            let length =
                usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
            let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
            frames.push((rest[3], rest[4], stream, rest[9..9 + length].to_vec()));
            rest = &rest[9 + length..];
        }
        frames
    }

    /// The header lists h2 would decode from the filter's output (a fresh decoder
    /// playing h2, fed every header block in order).
    fn decoded_by_server(bytes: &[u8]) -> Vec<Vec<(String, String)>> {
        let mut decoder = loona_hpack::Decoder::new();
        let mut lists = Vec::new();
        let mut block = Vec::new();
        for (kind, flags, _, payload) in frames_of(bytes) {
            match kind {
                TYPE_HEADERS => {
                    let (fragment, _) = headers_fragment(flags, &payload).unwrap();
                    block = fragment.to_vec();
                }
                TYPE_CONTINUATION => block.extend_from_slice(&payload),
                _ => continue,
            }
            if flags & FLAG_END_HEADERS != 0 {
                let list = decoder
                    .decode(&block)
                    .expect("the server can decode the block");
                lists.push(
                    list.into_iter()
                        .map(|(n, v)| {
                            (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap())
                        })
                        .collect(),
                );
            }
        }
        lists
    }

    fn authority_of(list: &[(String, String)]) -> Option<&str> {
        list.iter()
            .find(|(n, _)| n == ":authority")
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn grpc_core_socket_path_authority_becomes_localhost_and_nothing_else_changes() {
        let block = hex(GRPC_CORE_BLOCK);
        let input = connection(&[settings(), headers(1, &block), data(1, b"\0\0\0\0\x02hi")]);
        let (out, filter) = run(&input, input.len());
        assert_eq!(filter.rewritten_blocks, 1);
        let lists = decoded_by_server(&out);
        let original = decoded_by_server(&input);
        assert_eq!(authority_of(&original[0]), Some("tmp%2Frepro%2Fsniff.sock"));
        assert_eq!(authority_of(&lists[0]), Some("localhost"));
        let others = |l: &[(String, String)]| {
            l.iter()
                .filter(|(n, _)| n != ":authority")
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(
            others(&lists[0]),
            others(&original[0]),
            "every other field as sent"
        );
        let frames = frames_of(&out);
        assert_eq!(frames[0], frames_of(&input)[0], "SETTINGS untouched");
        assert_eq!(frames[2], frames_of(&input)[2], "DATA untouched");
    }

    #[test]
    fn the_same_bytes_whatever_the_read_sizes() {
        let mut encoder = loona_hpack::Encoder::new();
        let request = |encoder: &mut loona_hpack::Encoder, authority: &[u8]| {
            encoder.encode([
                (&b":method"[..], &b"POST"[..]),
                (b":scheme", b"http"),
                (
                    b":path",
                    b"/cubelet.services.volumeplugin.v1.VolumePluginService/Attach",
                ),
                (b":authority", authority),
                (b"content-type", b"application/grpc"),
                (b"te", b"trailers"),
            ])
        };
        let first = request(&mut encoder, b"/run/cube-csi-bridge/nfs.sock");
        let second = request(&mut encoder, b"/run/cube-csi-bridge/nfs.sock");
        let big = vec![7u8; 40_000];
        let input = connection(&[
            settings(),
            headers(1, &first),
            frame(0x0, 0, 1, &big),
            data(1, b"end"),
            headers(3, &second),
            data(3, b"x"),
        ]);
        let (whole, _) = run(&input, input.len());
        for chunk in [1, 2, 7, 9, 10, 100, 4096] {
            assert_eq!(run(&input, chunk).0, whole, "read size {chunk}");
        }
    }

    #[test]
    fn the_mirror_table_follows_indexed_references_across_requests() {
        // The client indexes the bad authority once and then refers to it by index:
        // the filter must still rewrite the later requests.
        let mut encoder = loona_hpack::Encoder::new();
        let headers_for = |encoder: &mut loona_hpack::Encoder, path: &[u8]| {
            encoder.encode([
                (&b":method"[..], &b"POST"[..]),
                (b":path", path),
                (b":authority", b"run%2Fcube-csi-bridge%2Fnfs.sock"),
                (b"x-call", path),
            ])
        };
        let blocks: Vec<Vec<u8>> = (0..5)
            .map(|i| headers_for(&mut encoder, format!("/s/M{i}").as_bytes()))
            .collect();
        assert!(
            blocks[4].len() < blocks[0].len(),
            "later blocks use the dynamic table"
        );
        let frames: Vec<Vec<u8>> = blocks
            .iter()
            .enumerate()
            .map(|(i, b)| headers(2 * i as u32 + 1, b))
            .collect();
        let (out, filter) = run(&connection(&frames), 3);
        assert_eq!(filter.rewritten_blocks, 5);
        let lists = decoded_by_server(&out);
        assert_eq!(lists.len(), 5);
        for (i, list) in lists.iter().enumerate() {
            assert_eq!(authority_of(list), Some("localhost"));
            let path = format!("/s/M{i}");
            assert!(list.contains(&(":path".into(), path.clone())), "{list:?}");
            assert!(list.contains(&("x-call".into(), path)), "{list:?}");
        }
    }

    #[test]
    fn a_valid_authority_passes_byte_for_byte() {
        // RFC 7541 C.4.1: Huffman-coded, `:authority: www.example.com`.
        let huffman = hex("828684418cf1e3c2e5f23a6ba0ab90f4ff");
        let mut encoder = loona_hpack::Encoder::new();
        let go_style = encoder.encode([
            (&b":method"[..], &b"POST"[..]),
            (b":authority", b"localhost"),
            (b":path", b"/a/B"),
        ]);
        let input = connection(&[settings(), headers(1, &huffman), headers(3, &go_style)]);
        let (out, filter) = run(&input, 5);
        assert_eq!(out, input);
        assert_eq!(filter.rewritten_blocks, 0);
        assert_eq!(
            authority_of(&decoded_by_server(&out)[0]),
            Some("www.example.com")
        );
    }

    #[test]
    fn after_a_rewrite_later_valid_blocks_are_re_encoded_too() {
        let mut encoder = loona_hpack::Encoder::new();
        let bad = encoder.encode([(&b":path"[..], &b"/a"[..]), (b":authority", b"/x.sock")]);
        // Refers to the indexed entries that only the client's table (and the mirror) has.
        let good = encoder.encode([(&b":path"[..], &b"/a"[..]), (b":authority", b"localhost")]);
        let input = connection(&[headers(1, &bad), headers(3, &good)]);
        let (out, filter) = run(&input, 4);
        assert_eq!(filter.rewritten_blocks, 2);
        let lists = decoded_by_server(&out);
        assert_eq!(
            lists[1],
            vec![
                (":path".into(), "/a".into()),
                (":authority".into(), "localhost".into())
            ]
        );
    }

    #[test]
    fn padding_priority_continuation_and_end_stream_are_kept() {
        let block = hex(GRPC_CORE_BLOCK);
        let (part1, part2) = block.split_at(40);
        let mut payload = vec![3u8]; // pad length
        payload.extend_from_slice(&[0x80, 0, 0, 0, 0x10]); // exclusive dep on 0, weight 16
        payload.extend_from_slice(part1);
        payload.extend_from_slice(&[0, 0, 0]);
        let input = connection(&[
            frame(
                TYPE_HEADERS,
                FLAG_PADDED | FLAG_PRIORITY | FLAG_END_STREAM,
                5,
                &payload,
            ),
            frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 5, part2),
        ]);
        let (out, _) = run(&input, 11);
        let frames = frames_of(&out);
        assert_eq!(frames.len(), 1, "one HEADERS frame fits");
        let (kind, flags, stream, payload) = &frames[0];
        assert_eq!((*kind, *stream), (TYPE_HEADERS, 5));
        assert_eq!(*flags, FLAG_PRIORITY | FLAG_END_STREAM | FLAG_END_HEADERS);
        assert_eq!(&payload[..5], &[0x80, 0, 0, 0, 0x10]);
        assert_eq!(authority_of(&decoded_by_server(&out)[0]), Some("localhost"));
    }

    #[test]
    fn a_large_rewritten_block_is_split_into_continuations() {
        let mut encoder = loona_hpack::Encoder::new();
        let long = vec![b'v'; 3 * MAX_WRITTEN_FRAME];
        let block = encoder.encode([
            (&b":authority"[..], &b"/run/x.sock"[..]),
            (b"x-long", &long[..]),
        ]);
        let (out, _) = run(&connection(&[headers(1, &block)]), 1000);
        let frames = frames_of(&out);
        assert!(frames.len() >= 4, "{}", frames.len());
        assert!(frames.iter().all(|f| f.3.len() <= MAX_WRITTEN_FRAME));
        assert_eq!(frames[0].0, TYPE_HEADERS);
        assert!(
            frames[1..]
                .iter()
                .all(|f| f.0 == TYPE_CONTINUATION && f.2 == 1)
        );
        let end_headers: Vec<bool> = frames.iter().map(|f| f.1 & FLAG_END_HEADERS != 0).collect();
        assert_eq!(end_headers.iter().filter(|e| **e).count(), 1);
        assert!(end_headers.last().unwrap());
        let list = &decoded_by_server(&out)[0];
        assert_eq!(authority_of(list), Some("localhost"));
        assert_eq!(list[1].1.len(), long.len());
    }

    #[test]
    fn steps_aside_for_anything_it_does_not_understand() {
        let http1 = b"GET / HTTP/1.1\r\nHost: /run/x.sock\r\n\r\n".to_vec();
        let garbage_hpack = connection(&[
            headers(1, &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
            data(1, b"x"),
        ]);
        let interrupted = connection(&[
            frame(TYPE_HEADERS, 0, 1, &hex(GRPC_CORE_BLOCK)[..10]),
            data(1, b"not a CONTINUATION"),
        ]);
        let bad_padding = connection(&[frame(
            TYPE_HEADERS,
            FLAG_PADDED | FLAG_END_HEADERS,
            1,
            &[9, 1],
        )]);
        let truncated = {
            let mut c = connection(&[headers(1, &hex(GRPC_CORE_BLOCK))]);
            c.truncate(c.len() - 3);
            c
        };
        for input in [http1, garbage_hpack, interrupted, bad_padding, truncated] {
            for chunk in [1, 5, input.len()] {
                let (out, filter) = run(&input, chunk);
                assert_eq!(out, input, "untouched, chunk {chunk}");
                assert!(filter.stepped_aside());
            }
        }
    }

    /// A header block that decodes to gigabytes: one 4 KiB literal added to the table,
    /// then a million 1-byte indexed references to it, sent as HEADERS + CONTINUATIONs.
    fn header_list_bomb() -> Vec<u8> {
        let mut block = vec![0x40];
        encode_string(b"x-bomb", &mut block);
        encode_string(&[b'a'; 4000], &mut block);
        // Index 62: the first dynamic table entry (RFC 7541 §2.3.3).
        block.resize(block.len() + 1_000_000, 0x80 | 62);
        let mut frames = vec![settings()];
        let chunks: Vec<&[u8]> = block.chunks(MAX_WRITTEN_FRAME).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let kind = if i == 0 {
                TYPE_HEADERS
            } else {
                TYPE_CONTINUATION
            };
            let flags = if i + 1 == chunks.len() {
                FLAG_END_HEADERS
            } else {
                0
            };
            frames.push(frame(kind, flags, 1, chunk));
        }
        connection(&frames)
    }

    #[test]
    fn a_header_list_bomb_is_passed_on_unchanged_without_being_collected() {
        let input = header_list_bomb();
        let (out, filter) = run(&input, input.len());
        assert!(out == input, "passed on untouched");
        assert!(filter.stepped_aside());
        assert!(
            filter.names_values.capacity() <= 2 * MAX_HEADER_LIST,
            "collected {} bytes",
            filter.names_values.capacity()
        );
        assert!(filter.fields.len() <= MAX_HEADER_LIST / 32);
    }

    /// The GOAWAY code h2 (limited to 16 KiB of header list as hyper configures it)
    /// answers the bomb with, bare or behind the filter.
    async fn h2_goaway_for_bomb(filtered: bool) -> u32 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        tokio::spawn(async move {
            let io: Pin<Box<dyn AsyncReadWrite>> = if filtered {
                Box::pin(AuthorityFix::new(server))
            } else {
                Box::pin(server)
            };
            let mut conn = h2::server::Builder::new()
                .max_header_list_size(16 << 10)
                .handshake::<_, bytes::Bytes>(io)
                .await
                .unwrap();
            while let Some(Ok(_)) = conn.accept().await {}
        });
        let input = header_list_bomb();
        let (mut read_half, mut write_half) = tokio::io::split(&mut client);
        let send = async {
            let _ = write_half.write_all(&input).await;
        };
        let goaway = async {
            loop {
                let mut head = [0u8; FRAME_HEADER_LEN];
                read_half.read_exact(&mut head).await.unwrap();
                let length =
                    usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
                let mut payload = vec![0u8; length];
                read_half.read_exact(&mut payload).await.unwrap();
                if head[3] == 0x7 {
                    return u32::from_be_bytes(payload[4..8].try_into().unwrap());
                }
            }
        };
        let (_, code) = tokio::time::timeout(std::time::Duration::from_secs(20), async {
            tokio::join!(send, goaway)
        })
        .await
        .expect("h2 answered");
        code
    }

    /// Behind the filter, h2 refuses the bomb as it does without it.
    #[tokio::test]
    async fn h2_refuses_a_header_list_bomb_behind_the_filter_as_without_it() {
        let bare = h2_goaway_for_bomb(false).await;
        assert_ne!(bare, 0, "h2 refuses the connection");
        assert_eq!(h2_goaway_for_bomb(true).await, bare);
    }

    #[test]
    fn integers_are_encoded_as_rfc_7541_says() {
        // RFC 7541 C.1.1 to C.1.3.
        let enc = |v, bits| {
            let mut out = Vec::new();
            encode_integer(v, bits, 0, &mut out);
            out
        };
        assert_eq!(enc(10, 5), [0x0a]);
        assert_eq!(enc(1337, 5), [0x1f, 0x9a, 0x0a]);
        assert_eq!(enc(42, 8), [0x2a]);
        assert_eq!(enc(127, 7), [0x7f, 0x00]);
    }

    trait AsyncReadWrite: AsyncRead + AsyncWrite + Send {}
    impl<T: AsyncRead + AsyncWrite + Send> AsyncReadWrite for T {}

    /// Reads server frames until a RST_STREAM; returns its error code.
    async fn read_reset(client: &mut tokio::io::DuplexStream) -> u32 {
        use tokio::io::AsyncReadExt;
        loop {
            let mut head = [0u8; FRAME_HEADER_LEN];
            client.read_exact(&mut head).await.unwrap();
            let length =
                usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            let mut payload = vec![0u8; length];
            client.read_exact(&mut payload).await.unwrap();
            if head[3] == 0x3 {
                return u32::from_be_bytes(payload[..4].try_into().unwrap());
            }
        }
    }

    /// Sends grpc-core's request to a real h2 server, bare or behind the filter: the
    /// authority the server accepted, or how it refused.
    async fn h2_server_sees(filtered: bool) -> Result<String, String> {
        use tokio::io::AsyncWriteExt;
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let server_task = tokio::spawn(async move {
            let io: Pin<Box<dyn AsyncReadWrite>> = if filtered {
                Box::pin(AuthorityFix::new(server))
            } else {
                Box::pin(server)
            };
            let mut conn = h2::server::handshake(io).await.unwrap();
            let accepted = conn.accept().await;
            // Keep driving the connection so that a reset reaches the client.
            tokio::spawn(async move { while conn.accept().await.is_some() {} });
            accepted.map(|r| r.map(|(req, _)| req.uri().authority().unwrap().to_string()))
        });
        let bytes = connection(&[settings(), headers(1, &hex(GRPC_CORE_BLOCK))]);
        client.write_all(&bytes).await.unwrap();
        tokio::select! {
            biased;
            accepted = server_task => match accepted.unwrap() {
                Some(Ok(authority)) => Ok(authority),
                other => Err(format!("{other:?}")),
            },
            code = read_reset(&mut client) => Err(format!("RST_STREAM code {code}")),
        }
    }

    /// The defect and its fix at the h2 level: grpc-core's request is reset by h2 with
    /// PROTOCOL_ERROR (1) on a bare connection, and reaches the service as `localhost`
    /// through the filter.
    #[tokio::test]
    async fn h2_refuses_the_socket_path_and_accepts_it_through_the_filter() {
        assert_eq!(
            h2_server_sees(false).await,
            Err("RST_STREAM code 1".into()),
            "PROTOCOL_ERROR"
        );
        assert_eq!(h2_server_sees(true).await, Ok("localhost".into()));
    }
}
