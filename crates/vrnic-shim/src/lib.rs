//! The vrnic driver library (placeholder).
