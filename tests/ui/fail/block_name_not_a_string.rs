// A name computed at run time must be a string; the error points at the expression.
use gpucache::cache_scope;

fn main() {
    for layer in 0..2usize {
        cache_scope!(name = layer, {
            let _ = layer;
        });
        let _ = cache_scope!(name = layer + 1, async {});
    }
}
