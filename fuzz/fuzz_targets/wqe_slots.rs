//! Fuzz target: `checks::wqe_slots` (see `checks.rs`).
#![no_main]

#[path = "checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::wqe_slots(data));
