//! Every form of the macros, compiled with every warning an error: the expansions must add no
//! warning (rustc's, and clippy's when `cargo clippy --all-targets -- -D warnings` checks this
//! file), must not trip `unused_qualifications` even where `gpucache::enter` is in scope, and
//! must keep the user's `#[must_use]`, doc comments and `#[inline]`.
#![deny(warnings, unused_qualifications, missing_docs)]
#![deny(clippy::all)]

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use gpucache::cache_scope;
use gpucache::prelude::*;

/// Public items, so that `missing_docs` checks that the attribute keeps doc comments.
pub mod api {
    // Not `use super::*`: in the parent, `use gpucache::cache_scope` shadows the prelude's
    // attribute of the same name, so a glob of the parent brings only the block macro.
    use std::fmt::Display;
    use std::pin::Pin;

    use gpucache::prelude::*;

    /// A documented, `#[must_use]`, `#[inline]` function.
    #[must_use]
    #[inline]
    #[cache_scope(documented)]
    pub fn documented(x: u32) -> u32 {
        x + 1
    }

    /// The same, with the attribute first and a string name.
    #[cache_scope("documented again")]
    #[inline(always)]
    #[must_use = "the value is the point"]
    pub fn documented_again() -> Option<String> {
        gpucache::current_scope()
    }

    /// A type with methods in scopes.
    #[derive(Debug, Default)]
    pub struct Model {
        /// Steps taken.
        pub steps: u32,
    }

    impl Model {
        /// An associated function.
        #[cache_scope(model_new)]
        #[must_use]
        pub fn new() -> Self {
            Self::default()
        }

        /// `&self`.
        #[cache_scope(model_steps)]
        #[must_use]
        pub fn steps(&self) -> u32 {
            self.steps
        }

        /// `&mut self`, returning a `Result` through `?`.
        ///
        /// # Errors
        /// When the allocation fails.
        #[cache_scope(model_step)]
        pub fn step(&mut self) -> Result<()> {
            let _buffer = Array::<f32>::zeros(Device::Cpu, [4])?;
            self.steps += 1;
            Ok(())
        }

        /// `self`.
        #[cache_scope(model_finish)]
        #[must_use]
        pub fn finish(self) -> u32 {
            self.steps
        }

        /// `async fn` with `&self`.
        #[cache_scope(model_load)]
        pub async fn load(&self, extra: u32) -> u32 {
            self.steps + extra
        }

        /// `async fn` returning a borrow with an elided lifetime, and `Self`.
        #[cache_scope(model_name)]
        pub async fn name<'a>(&self, names: &'a [&'a str]) -> (&'a str, &Self) {
            (names[0], self)
        }

        /// `async unsafe fn` returning `()`.
        ///
        /// # Safety
        /// `ptr` must be valid for writes.
        #[cache_scope(model_write)]
        pub async unsafe fn write(&mut self, ptr: *mut u32) {
            // SAFETY: the caller promises `ptr` is valid for writes.
            unsafe { *ptr = self.steps };
        }
    }

    /// Generic, with a `where` clause.
    #[cache_scope(generic)]
    pub fn total<T, I>(items: I) -> T
    where
        I: IntoIterator<Item = T>,
        T: std::iter::Sum<T>,
    {
        items.into_iter().sum()
    }

    /// `impl Trait` in argument and return position.
    #[cache_scope(opaque)]
    pub fn show(value: impl Display) -> impl Display {
        format!("<{value}>")
    }

    /// Reads `*ptr`.
    ///
    /// # Safety
    /// `ptr` must be valid for reads.
    #[cache_scope(raw)]
    pub unsafe fn read(ptr: *const u32) -> u32 {
        // SAFETY: the caller promises `ptr` is valid for reads.
        unsafe { *ptr }
    }

    /// `async fn`, generic, with `impl Trait` and an early `?`.
    ///
    /// # Errors
    /// When `text` is not a number.
    #[cache_scope(parse)]
    pub async fn parse<T>(text: &str, extra: impl Display) -> Result<String, T::Err>
    where
        T: std::str::FromStr + Display,
    {
        let value: T = text.parse()?;
        Ok(format!("{value}{extra}"))
    }

    /// A sync fn returning `impl Future`, with a synchronous part and an early `return`.
    #[cache_scope(opaque_future)]
    pub fn opaque_future(early: bool) -> impl Future<Output = u32> + Send {
        let offset = u32::from(early);
        if early {
            return std::future::ready(offset);
        }
        std::future::ready(offset + 10)
    }

    /// A sync fn returning a boxed future, as `async-trait` writes an `async fn` in a trait.
    #[cache_scope(boxed_future)]
    pub fn boxed_future<'a>(model: &'a Model) -> Pin<Box<dyn Future<Output = u32> + Send + 'a>> {
        Box::pin(async move { model.steps })
    }

    /// `async fn` whose whole body awaits another future.
    #[cache_scope(forward)]
    pub async fn forward(model: &Model) -> u32 {
        model.load(1).await
    }
}

/// Here `gpucache::enter` (and every root name) is in scope unqualified, which is where the
/// expansions' `::gpucache::__private::enter` could look like an unneeded qualification.
mod glob {
    use gpucache::*;

    #[prelude::cache_scope(glob_attr)]
    pub(crate) fn attr() -> Option<String> {
        current_scope()
    }

    #[prelude::cache_scope(glob_async)]
    pub(crate) async fn attr_async() -> Option<String> {
        current_scope()
    }

    pub(crate) fn block() -> Option<String> {
        let _plain = enter("plain");
        cache_scope!(glob_block, { current_scope() })
    }
}

fn block_forms(values: &[&str]) -> Result<u32, std::num::ParseIntError> {
    let mut total = 0;
    for text in values {
        let value: u32 = cache_scope!(block_parse, {
            if text.is_empty() {
                continue;
            }
            let value: u32 = text.parse()?;
            if value == 0 {
                return Ok(0);
            }
            if value > 100 {
                break;
            }
            value
        });
        total += value;
    }
    total += cache_scope!("an expression", total + 1);
    total += gpucache::cache_scope!(qualified, { 1 });
    cache_scope!(statement, {
        total += 1;
    });
    Ok(total)
}

async fn block_async() -> u32 {
    let future = cache_scope!(async_block, async { 2 });
    let value = future.await;
    let layer = 1;
    let value = cache_scope!(name = format!("layer{layer}"), async move { value + layer }).await;
    cache_scope!(awaits, { std::future::ready(value).await })
}

fn block_run_time_names(names: &[String]) -> Result<usize, std::num::ParseIntError> {
    let mut total = 0;
    for name in names {
        total += cache_scope!(name = name, {
            let value: usize = "1".parse()?;
            value
        });
        total += cache_scope!(name = name.as_str(), name.len());
    }
    Ok(total)
}

fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    loop {
        if let Poll::Ready(value) = future
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
        {
            return value;
        }
    }
}

#[test]
fn every_form_compiles_warning_free_and_runs() {
    use api::*;
    assert_eq!(documented(1), 2);
    assert_eq!(documented_again().as_deref(), Some("documented again"));
    let mut model = Model::new();
    model.step().unwrap();
    assert_eq!(model.steps(), 1);
    assert_eq!(block_on(model.load(2)), 3);
    assert_eq!(block_on(forward(&model)), 2);
    assert_eq!(block_on(model.name(&["a"])).0, "a");
    let mut out = 0;
    // SAFETY: `&mut out` is valid for writes.
    block_on(unsafe { model.write(&mut out) });
    assert_eq!(out, 1);
    assert_eq!(model.finish(), 1);
    assert_eq!(total([1, 2]), 3);
    assert_eq!(show(4).to_string(), "<4>");
    let value = 5;
    // SAFETY: `&value` is valid for reads.
    assert_eq!(unsafe { read(&value) }, 5);
    assert_eq!(block_on(parse::<u8>("7", '!')).as_deref(), Ok("7!"));
    assert!(block_on(parse::<u8>("x", '!')).is_err());
    assert_eq!(glob::attr().as_deref(), Some("glob_attr"));
    assert_eq!(block_on(glob::attr_async()).as_deref(), Some("glob_async"));
    assert_eq!(glob::block().as_deref(), Some("glob_block"));
    assert_eq!(block_forms(&["1", "", "2", "200"]), Ok(3 + 4 + 1 + 1));
    assert_eq!(block_forms(&["0"]), Ok(0));
    assert_eq!(block_on(block_async()), 3);
    assert_eq!(block_run_time_names(&["ab".to_owned()]), Ok(3));
    assert_eq!(block_on(opaque_future(true)), 1);
    assert_eq!(block_on(opaque_future(false)), 10);
    assert_eq!(block_on(boxed_future(&Model::new())), 0);
    assert_eq!(gpucache::current_scope(), None);
}
