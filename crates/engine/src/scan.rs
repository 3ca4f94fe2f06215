//! Finding the first of a few bytes eight bytes at a time: pointer walks read every byte of
//! every token, and the patch writer every byte of every string, where a byte-at-a-time loop
//! cost a few percent of an admission.

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// The high bit of each byte of `word` that equals `byte` (and, above the first such byte,
/// possibly of others: only the lowest one is read).
pub(crate) fn equal(word: u64, byte: u8) -> u64 {
    let x = word ^ (ONES * u64::from(byte));
    x.wrapping_sub(ONES) & !x & HIGHS
}

/// The high bit of each byte of `word` below `limit` (at most 0x80), with the same caveat.
pub(crate) fn below(word: u64, limit: u8) -> u64 {
    word.wrapping_sub(ONES * u64::from(limit)) & !word & HIGHS
}

/// Where the first byte that `is` holds for is. `flags` marks such bytes of a word (read as
/// little-endian) with their high bit, as [`equal`] and [`below`] do.
#[inline]
pub(crate) fn first(
    bytes: &[u8],
    flags: impl Fn(u64) -> u64,
    is: impl Fn(u8) -> bool,
) -> Option<usize> {
    let mut chunks = bytes.chunks_exact(8);
    let mut at = 0;
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let found = flags(u64::from_le_bytes(word));
        if found != 0 {
            return Some(at + (found.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    chunks
        .remainder()
        .iter()
        .position(|&b| is(b))
        .map(|i| at + i)
}
