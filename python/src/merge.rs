//! Where a sample's Python frames go in its native walk.
//!
//! Each run of `_PyEval_EvalFrameDefault` on the native stack evaluates one
//! activation of Python frames: the frames from the innermost down to the
//! one marked as its entry (entered from C). Walking both stacks from the
//! innermost frame, the n-th native evaluation frame is replaced by the
//! n-th activation, so a C function that calls back into Python (`sorted`
//! with a `key=`, `json.dumps` with a `default=`) stays between the two
//! activations it separates.

use std::ops::Range;

use agent_common::PythonFrame;

/// One frame of a merged stack, innermost first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merged {
    /// The native frame at this index of the walk.
    Native(usize),
    /// A Python frame.
    Python(PythonFrame),
    /// Where the read of an activation stopped short of its entry (the
    /// sampler's frame limit, or a read that failed): its outer Python
    /// frames, not read, would be here.
    Cut,
}

/// What merging a sample did, for the agent's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MergeCounts {
    /// Native evaluation frames replaced by their Python frames.
    pub replaced: usize,
    /// Activations with no native evaluation frame left to replace (the
    /// native walk stopped short of them): left out.
    pub unplaced: usize,
}

/// Merges `python` (innermost first, activations ending at
/// [`PythonFrame::ENTRY`]) into the native walk `native` (return
/// addresses but for the first, innermost first), whose evaluation frames
/// are those in `eval` (the code of `_PyEval_EvalFrameDefault`, its split
/// parts included). Appends
/// to `out`. `cut`: the read stopped before the outermost frame, so
/// [`Merged::Cut`] marks, once, where the frames not read would be: after
/// the last activation when it has no entry, else in place of the first
/// evaluation frame left (3.10 reads one frame per activation: a deep
/// recursion is cut between activations); evaluation frames further out
/// are left out, their frames not read either.
pub fn merge(
    native: &[u64],
    eval: &[Range<u64>],
    python: &[PythonFrame],
    cut: bool,
    out: &mut Vec<Merged>,
) -> MergeCounts {
    let mut counts = MergeCounts::default();
    let mut marked = false;
    let mut activations = python
        .split_inclusive(|frame| frame.first_line & PythonFrame::ENTRY != 0)
        .peekable();
    for (index, &address) in native.iter().enumerate() {
        // A return address lies after its call: the call is in the
        // function one byte before it.
        let in_function = if index == 0 {
            address
        } else {
            address.wrapping_sub(1)
        };
        if !eval.iter().any(|code| code.contains(&in_function)) {
            out.push(Merged::Native(index));
        } else if let Some(activation) = activations.next() {
            out.extend(activation.iter().copied().map(Merged::Python));
            let entered = activation
                .last()
                .is_some_and(|frame| frame.first_line & PythonFrame::ENTRY != 0);
            if cut && !entered && activations.peek().is_none() {
                out.push(Merged::Cut);
                marked = true;
            }
            counts.replaced += 1;
        } else if !cut {
            out.push(Merged::Native(index));
        } else if !marked {
            out.push(Merged::Cut);
            marked = true;
        }
    }
    counts.unplaced = activations.count();
    counts
}

#[cfg(test)]
// The loop's code is a list of ranges; most tests' list has one.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    fn frame(code: u64, entry: bool) -> PythonFrame {
        PythonFrame {
            code,
            instr_offset: 0,
            first_line: 1 | if entry { PythonFrame::ENTRY } else { 0 },
        }
    }

    #[test]
    fn a_frame_in_a_part_split_off_the_loop_is_an_evaluation_frame() {
        // The loop's symbol at 0x1000, its cold part (where it runs) at
        // 0x9000: a frame in either takes an activation.
        let python = [frame(1, true), frame(2, true)];
        let eval = [0x1000..0x1100, 0x9000..0xa000];
        let native = [0x9500, 0x6000, 0x1080, 0x7000];
        let mut out = Vec::new();
        let counts = merge(&native, &eval, &python, false, &mut out);
        assert_eq!(
            out,
            [
                Merged::Python(python[0]),
                Merged::Native(1),
                Merged::Python(python[1]),
                Merged::Native(3),
            ]
        );
        assert_eq!(counts.replaced, 2);
    }

    #[test]
    fn each_evaluation_frame_takes_its_own_activation_in_order() {
        // leaf <- key_function (entry: called by sorted) | sorted's C frames
        // | main <- <module> (entry).
        let python = [
            frame(1, false),
            frame(2, true),
            frame(3, false),
            frame(4, true),
        ];
        let eval = [0x1000..0x2000];
        // leaf's native frames, eval, sorted (C), eval, PyEval_EvalCode, main.
        let native = [0x5000, 0x1100, 0x6000, 0x1200, 0x7000, 0x8000];
        let mut out = Vec::new();
        let counts = merge(&native, &eval, &python, false, &mut out);
        assert_eq!(
            out,
            [
                Merged::Native(0),
                Merged::Python(python[0]),
                Merged::Python(python[1]),
                Merged::Native(2),
                Merged::Python(python[2]),
                Merged::Python(python[3]),
                Merged::Native(4),
                Merged::Native(5),
            ]
        );
        assert_eq!(
            counts,
            MergeCounts {
                replaced: 2,
                unplaced: 0
            }
        );
    }

    #[test]
    fn a_return_address_just_past_the_function_is_still_in_it() {
        let eval = [0x1000..0x2000];
        let python = [frame(1, true)];
        let mut out = Vec::new();
        // The call is the function's last instruction: its return address
        // is the function's end.
        merge(&[0x5000, 0x2000], &eval, &python, false, &mut out);
        assert_eq!(out, [Merged::Native(0), Merged::Python(python[0])]);
        // The innermost frame is an address in the function, not a return
        // address: its end is outside.
        out.clear();
        merge(&[0x2000], &eval, &python, false, &mut out);
        assert_eq!(out, [Merged::Native(0)]);
    }

    #[test]
    fn frames_without_a_partner_stay_as_they_are_and_are_counted() {
        let eval = [0x1000..0x2000];
        let python = [frame(1, true), frame(2, true)];
        let mut out = Vec::new();
        // A walk that stopped after one evaluation frame.
        let counts = merge(&[0x5000, 0x1100], &eval, &python, false, &mut out);
        assert_eq!(out, [Merged::Native(0), Merged::Python(python[0])]);
        assert_eq!(
            counts,
            MergeCounts {
                replaced: 1,
                unplaced: 1
            }
        );
        // More evaluation frames than activations (no thread state read).
        out.clear();
        let counts = merge(&[0x1100, 0x1200], &eval, &[], false, &mut out);
        assert_eq!(out, [Merged::Native(0), Merged::Native(1)]);
        assert_eq!(counts, MergeCounts::default());
    }

    #[test]
    fn a_cut_read_marks_where_its_last_activation_stops() {
        let eval = [0x1000..0x2000];
        // An inner activation read whole, the outer one cut after `2`.
        let python = [frame(1, true), frame(2, false)];
        let native = [0x5000, 0x1100, 0x6000, 0x1200, 0x8000];
        let mut out = Vec::new();
        merge(&native, &eval, &python, true, &mut out);
        assert_eq!(
            out,
            [
                Merged::Native(0),
                Merged::Python(python[0]),
                Merged::Native(2),
                Merged::Python(python[1]),
                Merged::Cut,
                Merged::Native(4),
            ]
        );
        // Cut right after an entry (3.10's frames are an activation each):
        // the next evaluation frame is where the frames not read go.
        out.clear();
        merge(&native, &eval, &python[..1], true, &mut out);
        assert_eq!(
            out,
            [
                Merged::Native(0),
                Merged::Python(python[0]),
                Merged::Native(2),
                Merged::Cut,
                Merged::Native(4),
            ]
        );
        // Evaluation frames further out are left out: one mark.
        out.clear();
        let deeper = [0x5000, 0x1100, 0x6000, 0x1200, 0x6000, 0x1300, 0x8000];
        merge(&deeper, &eval, &python, true, &mut out);
        assert_eq!(
            out,
            [
                Merged::Native(0),
                Merged::Python(python[0]),
                Merged::Native(2),
                Merged::Python(python[1]),
                Merged::Cut,
                Merged::Native(4),
                Merged::Native(6),
            ]
        );
        // Not cut: an activation without its entry is the innermost part
        // of one whose entry the walk has not reached (never marked).
        out.clear();
        merge(&native, &eval, &python, false, &mut out);
        assert!(!out.contains(&Merged::Cut), "{out:?}");
    }
}
