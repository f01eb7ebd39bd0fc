//! The false-hit guard of a semantic match (SPEC §16): the numbers and the negations
//! of a message, which two messages must share for one to answer the other.
