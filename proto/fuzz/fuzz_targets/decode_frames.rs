//! Feeds arbitrary bytes to the wkproto decoder the way a transport does:
//! the first byte picks the version and the frame limit, the rest is the
//! receive buffer. Every decoded frame must re-encode and decode to itself;
//! errors are fine, panics and over-consumption are bugs.
#![no_main]

use libfuzzer_sys::fuzz_target;
use proto::wkproto::{decode, decode_connect, peek_frame_len, MAX_FRAME_BYTES};

fuzz_target!(|data: &[u8]| {
    let Some((&sel, buf)) = data.split_first() else {
        return;
    };
    let version = sel & 0x07; // 0..=7: below, inside and above 2..=6
    let max = if sel & 0x80 != 0 { 64 } else { MAX_FRAME_BYTES };
    let _ = decode_connect(buf, max);
    let _ = peek_frame_len(buf, max);
    let mut off = 0;
    let mut out = Vec::new();
    while let Ok(Some((frame, used))) = decode(&buf[off..], version, max) {
        assert!(used >= 1 && used <= buf.len() - off);
        out.clear();
        let n = frame
            .encode(version, &mut out)
            .expect("decoded frames re-encode");
        assert_eq!(n, out.len());
        assert_eq!(
            decode(&out, version, usize::MAX),
            Ok(Some((frame, n))),
            "re-encoded frame decodes to itself"
        );
        off += used;
    }
});
