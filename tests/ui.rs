//! Compile-time behaviour of the macros (trybuild): the forms that must compile, and every
//! misuse, whose error message and span are pinned by the reviewed `.stderr` files beside each
//! case.
//!
//! Those files are rustc's exact output, which changes from one compiler release to the next,
//! so they belong to one toolchain: stable 1.95, the one this repository is tested with. On any
//! other compiler (a newer stable, beta, nightly, or the minimum supported 1.88) the test is
//! ignored, and `cargo test` lists it as ignored with the reason; the macros themselves are
//! still compiled and run there by tests/macros.rs and tests/macros_lint.rs.
//!
//! * To run the cases on another compiler anyway: `cargo test --test ui -- --ignored`.
//! * After a deliberate change of a message: `TRYBUILD=overwrite cargo test --test ui`, and
//!   review the diff.
//! * To move to a new toolchain: change `stable(1.95)` below (and the version above), regenerate
//!   the files as above on that toolchain, and review the diff.

#[rustversion::attr(
    not(stable(1.95)),
    ignore = "the .stderr files are rustc 1.95's output: run on stable 1.95, or with `--ignored`"
)]
#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("tests/ui/pass/*.rs");
    cases.compile_fail("tests/ui/fail/*.rs");
}
