//! The vrnic daemon (placeholder).
