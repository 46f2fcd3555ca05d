// The macros keep the user's tokens and spans: type errors in a body point at the user's
// code, not at the macro.
use gpucache::cache_scope;
use gpucache::prelude::*;

#[cache_scope(step)]
fn sync_body() -> u32 {
    "not a number"
}

#[cache_scope(step)]
async fn async_body() -> u32 {
    "not a number"
}

#[cache_scope(step)]
async fn async_early_return(early: bool) -> u32 {
    if early {
        return "not a number";
    }
    1
}

#[cache_scope(step)]
async fn async_question_mark() -> Result<u32, std::fmt::Error> {
    let n: u32 = "1".parse()?;
    Ok(n)
}

#[cache_scope(step)]
fn opaque_future() -> impl std::future::Future<Output = u32> {
    async { "not a number" }
}

#[cache_scope(step)]
fn boxed_future() -> std::pin::Pin<Box<dyn std::future::Future<Output = u32>>> {
    Box::pin(async { "not a number" })
}

fn main() {
    let _: u32 = cache_scope!(step, { "not a number" });
}
