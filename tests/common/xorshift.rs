//! xorshift64*: a small seeded generator for the planner's property tests (tests/plan_props.rs,
//! tests/plan_hostile.rs), good enough to explore layouts and extreme values.
#![allow(dead_code)]

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u64 + 1) as usize);
        }
    }

    /// Values that stress 64-bit arithmetic: small, near powers of two, near the top.
    pub fn extreme(&mut self) -> u64 {
        match self.below(6) {
            0 => self.below(4),
            1 => 1 << self.below(64),
            2 => (1u64 << self.below(64)).wrapping_sub(1),
            3 => u64::MAX - self.below(4),
            4 => u64::MAX / (1 + self.below(8)),
            _ => self.next(),
        }
    }
}
