use gpucache::cache_scope;

fn main() {
    cache_scope!(step);
    cache_scope!("step",);
    cache_scope!();
}
