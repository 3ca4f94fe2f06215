//! A small deterministic PRNG (SplitMix64): the same seed gives the same cases on every
//! machine, with no dependency.

pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The seed of case `index` of a run seeded with `seed`: cases can be regenerated one by
    /// one, without running the ones before.
    pub fn case_seed(seed: u64, index: u64) -> u64 {
        let mut r = Rng(seed ^ index.wrapping_mul(0xA076_1D64_78BD_642F));
        r.next_u64()
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        debug_assert!(n > 0);
        ((self.next_u64() >> 11) % n as u64) as usize
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u32) -> bool {
        self.below(100) < percent as usize
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// A small count, biased towards 0 and 1, sometimes up to `max`.
    pub fn small(&mut self, max: usize) -> usize {
        match self.below(10) {
            0..=3 => self.below(2.min(max + 1)),
            4..=7 => self.below(4.min(max + 1)),
            _ => self.below(max + 1),
        }
    }

    pub fn byte(&mut self) -> u8 {
        self.next_u64() as u8
    }
}
