//! Code generation. The generated code names only `::gpucache::__private` and a guard variable
//! that the user's code cannot see; everything else is the user's tokens, with their spans.

use proc_macro2::{Ident, Span, TokenStream, TokenTree};
use quote::{ToTokens, quote, quote_spanned};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{
    Expr, GenericArgument, ItemFn, LitStr, PathArguments, ReturnType, Signature, Stmt, Token, Type,
    TypeParamBound, TypePath, parse_quote, parse_quote_spanned,
};

use crate::attr::{BlockArgs, BlockName, ScopeName};

/// The guard variable. It has a mixed-site span, which hides it from the user's code: a user
/// variable of the same name neither shadows it nor is shadowed by it.
fn guard() -> Ident {
    Ident::new("__gpucache_scope", Span::mixed_site())
}

/// `let <guard> = ::gpucache::__private::enter("name");`.
fn enter(name: &LitStr) -> Stmt {
    let guard = guard();
    parse_quote! {
        let #guard = ::gpucache::__private::enter(#name);
    }
}

/// `#[cache_scope(name)]` on `func`: the signature, attributes (outer and inner) and the body's
/// braces and statements stay the user's, so errors in the body point at the user's code.
///
/// * A sync fn gets the guard as its first statement, so every way out of the body (the tail,
///   `return`, `?`, a panic) exits the scope, after the body's locals are dropped.
/// * An `async fn` keeps its signature (so its lifetimes and `Send`-ness are inferred as
///   before) and its body becomes `instrument(name, async move { body }).await`: the scope is
///   entered around each poll of the body's future, never held across an `.await`.
/// * A sync fn that returns a future (`impl Future<..>`, or `Pin<Box<dyn Future<..>>>` as
///   `async-trait` writes it) is an `async fn` written out: its body runs in the scope, in a
///   closure so that a `return` in it is caught too, and the future it makes is wrapped so
///   that each of its polls runs in the scope (a boxed future is boxed again, to keep the
///   declared type).
pub(crate) fn attribute(name: &ScopeName, mut func: ItemFn) -> TokenStream {
    let name = name.lit();
    if func.sig.asyncness.is_some() {
        let stmts = std::mem::take(&mut func.block.stmts);
        let typed_return = typed_return(&func.sig);
        let body = quote! {
            ::gpucache::__private::instrument(
                ::gpucache::__private::Literal(#name),
                async move { #typed_return #(#stmts)* },
            )
            .await
        };
        func.block
            .stmts
            .push(Stmt::Expr(Expr::Verbatim(body), None));
        return func.into_token_stream();
    }
    let stmts = &func.block.stmts;
    let body = match returned_future(&func.sig.output) {
        None => {
            func.block.stmts.insert(0, enter(&name));
            return func.into_token_stream();
        }
        Some(Returned::Opaque) => {
            quote! { ::gpucache::__private::instrument_fn(#name, move || { #(#stmts)* }) }
        }
        Some(Returned::Boxed(ty)) => quote! {
            ::std::boxed::Box::pin(
                ::gpucache::__private::instrument_fn(#name, move || -> #ty { #(#stmts)* })
            )
        },
    };
    func.block.stmts = vec![Stmt::Expr(Expr::Verbatim(body), None)];
    func.into_token_stream()
}

/// The kinds of future a sync fn can be seen to return from its signature.
enum Returned<'a> {
    /// `impl Future<..> + ..`.
    Opaque,
    /// `Pin<Box<dyn Future<..> + ..>>`, this type.
    Boxed(&'a Type),
}

/// Whether the function returns a future its body makes (and of which kind). Only the shapes
/// that can be told from the tokens count: a type alias such as `BoxFuture` cannot be.
fn returned_future(output: &ReturnType) -> Option<Returned<'_>> {
    let ReturnType::Type(_, ty) = output else {
        return None;
    };
    match unwrap(ty) {
        Type::ImplTrait(opaque) => has_future(&opaque.bounds).then_some(Returned::Opaque),
        Type::Path(pin) => {
            let boxed = only_type_arg(pin, "Pin")?;
            let Type::Path(boxed) = unwrap(boxed) else {
                return None;
            };
            let Type::TraitObject(object) = unwrap(only_type_arg(boxed, "Box")?) else {
                return None;
            };
            has_future(&object.bounds).then_some(Returned::Boxed(ty))
        }
        _ => None,
    }
}

/// `ty` without parentheses and invisible groups (which macros such as `async-trait` leave).
fn unwrap(ty: &Type) -> &Type {
    match ty {
        Type::Group(group) => unwrap(&group.elem),
        Type::Paren(paren) => unwrap(&paren.elem),
        ty => ty,
    }
}

/// The type argument of `path` when it is `...::name<T>`.
fn only_type_arg<'a>(path: &'a TypePath, name: &str) -> Option<&'a Type> {
    let last = path.path.segments.last()?;
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    match args.args.first()? {
        GenericArgument::Type(ty) if last.ident == name && args.args.len() == 1 => Some(ty),
        _ => None,
    }
}

/// Whether one of `bounds` is `...::Future<..>`.
fn has_future(bounds: &Punctuated<TypeParamBound, Token![+]>) -> bool {
    bounds.iter().any(|bound| match bound {
        TypeParamBound::Trait(bound) => bound
            .path
            .segments
            .last()
            .is_some_and(|last| last.ident == "Future"),
        _ => false,
    })
}

/// A `return` of the `async fn`'s declared type that is never taken, put first in the async
/// block. Rust infers an async block's output type from its body, so without it a type error in
/// the body would surface at the `.await` of the block, which rustc points at the attribute;
/// with it, the output type is known before the body is checked, and the error points at the
/// user's expression (with a note at the declared return type), and `?` converts errors into
/// the declared type. A return type with an `impl Trait` in it cannot be written as a `let`
/// type, and gets none.
fn typed_return(sig: &Signature) -> Option<TokenStream> {
    let (ty, at) = match &sig.output {
        ReturnType::Default => (quote!(()), sig.ident.span()),
        ReturnType::Type(_, ty) if mentions_impl(ty.to_token_stream()) => return None,
        ReturnType::Type(_, ty) => (ty.to_token_stream(), ty.span()),
    };
    // Hidden from the user's code like the guard, but located at the return type for rustc's
    // "return type inferred to be ... here".
    let span = Span::mixed_site().located_at(at);
    let value = Ident::new("__gpucache_return", span);
    let ret = quote_spanned!(span=> return);
    Some(quote! {
        #[allow(
            unreachable_code,
            clippy::diverging_sub_expression,
            clippy::empty_loop,
            clippy::let_unit_value,
            clippy::needless_return
        )]
        if false {
            let #value: #ty = loop {};
            #ret #value;
        }
    })
}

/// Whether `tokens` contain the keyword `impl`, at any depth.
fn mentions_impl(tokens: TokenStream) -> bool {
    tokens.into_iter().any(|token| match token {
        TokenTree::Ident(ident) => ident == "impl",
        TokenTree::Group(group) => mentions_impl(group.stream()),
        _ => false,
    })
}

/// `cache_scope!(name, body)`: a plain block holding the guard, so `return`, `?`,
/// `break`/`continue` and `.await` in the body act as in any block. A `{ ... }` body gets the
/// guard as its first statement (its braces stay the user's, and no needless nested block is
/// made); any other expression becomes the tail of a new block. An `async` block body is
/// instrumented instead (a guard would only cover the creation of the future).
///
/// A name computed at run time (`name = <expr>`) is the user's expression, as they wrote it,
/// passed by value to the function that needs it to be a string, so that a wrong type is
/// reported at the expression: evaluated once, before the body, as a function argument is.
pub(crate) fn block(args: BlockArgs) -> TokenStream {
    let BlockArgs { name, body } = args;
    match (name, body) {
        (BlockName::Fixed(name), body @ Expr::Async(_)) => {
            let name = name.lit();
            quote! { ::gpucache::__private::instrument(::gpucache::__private::Literal(#name), #body) }
        }
        (BlockName::Computed(name), body @ Expr::Async(_)) => {
            let at = at_expr(&name);
            quote_spanned! {at=> ::gpucache::__private::instrument(#name, #body) }
        }
        (name, body) => {
            let enter = match name {
                BlockName::Fixed(name) => enter(&name.lit()),
                BlockName::Computed(name) => {
                    let guard = guard();
                    let at = at_expr(&name);
                    parse_quote_spanned! {at=>
                        let #guard = ::gpucache::__private::enter_named(#name);
                    }
                }
            };
            match body {
                Expr::Block(mut block) => {
                    block.block.stmts.insert(0, enter);
                    block.into_token_stream()
                }
                body => quote! { { #enter #body } },
            }
        }
    }
}

/// A span for the call that takes the name computed at run time: located at the user's
/// expression (so that rustc's "required by a bound introduced by this call" points there too,
/// not at the whole macro call), resolved at the call site.
fn at_expr(expr: &Expr) -> Span {
    Span::call_site().located_at(expr.span())
}
