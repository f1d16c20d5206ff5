//! flashattn-candle's tests: one binary (candle is large to link).

mod backward;
mod common;
mod errors;
mod forward;
