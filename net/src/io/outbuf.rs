//! Output buffers, shared by the connection table (`core`) and the TLS layer
//! (`tls`): a buffer that grew for a burst gives its memory back once written.

/// An output buffer whose capacity passed this is released once written, so a
/// connection does not keep a burst's buffer.
pub(crate) const OUTPUT_KEEP_BYTES: usize = 4096;

/// Clears a written output buffer, releasing its memory when it grew past
/// [`OUTPUT_KEEP_BYTES`].
pub(crate) fn recycle(buf: &mut Vec<u8>) {
    if buf.capacity() > OUTPUT_KEEP_BYTES {
        *buf = Vec::new();
    } else {
        buf.clear();
    }
}
