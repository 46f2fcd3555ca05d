use gpucache::cache_scope;

fn main() {
    let _ = cache_scope!(name =, { 1 });
    let _ = cache_scope!(name = , async { 1 });
    let _ = cache_scope!(name = "step");
    let _ = cache_scope!(name == "step", { 1 });
}
