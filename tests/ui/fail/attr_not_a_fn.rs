use gpucache::prelude::*;

#[cache_scope(step)]
pub(crate) struct Model {
    weights: Vec<f32>,
}

#[cache_scope(step)]
impl Model {
    fn step(&self) -> usize {
        self.weights.len()
    }
}

#[cache_scope(step)]
const STEPS: usize = 3;

#[cache_scope(step)]
mod training {}

trait Train {
    #[cache_scope(step)]
    fn step(&mut self);
}

fn main() {
    let model = Model { weights: vec![] };
    let _ = (model.step(), STEPS);
}
