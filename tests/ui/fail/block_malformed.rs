use gpucache::cache_scope;

fn main() {
    let _ = cache_scope!(step { 1 });
    let _ = cache_scope!(step, { 1 }, { 2 });
    let _ = cache_scope!("", { 1 });
    let _ = cache_scope!(42, { 1 });
    let _ = cache_scope!(reuse = "immediate", { 1 });
    let _ = cache_scope!(step, move |x: u32| x + 1);
}
