//! Fuzz target: `checks::link_control` (see `checks.rs`).
#![no_main]

#[path = "checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::link_control(data));
