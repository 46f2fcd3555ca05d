//! Compile-time behaviour of the macros (trybuild): the forms that must compile, and every
//! misuse, whose error message and span are pinned by the reviewed `.stderr` files beside each
//! case. After a deliberate change of a message, regenerate them with `TRYBUILD=overwrite` and
//! review the diff.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("tests/ui/pass/*.rs");
    cases.compile_fail("tests/ui/fail/*.rs");
}
